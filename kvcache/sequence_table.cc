#include "kvcache/sequence_table.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnd {
namespace {

constexpr size_t kIdBytes = 16;  // 128 bits: unguessable, so an id is a capability
constexpr size_t kIdChars = 2 * kIdBytes;
// How much of a malformed id an error message echoes back (ids can be attacker-sized).
constexpr size_t kMaxEchoedIdChars = 64;

// Fills buf from the kernel CSPRNG: getrandom(2), or /dev/urandom where the syscall is missing
// (old kernels, some sandboxes). Never a userspace PRNG: ids must not be predictable from others.
absl::Status FillRandom(unsigned char* buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(buf + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  if (got == n) return absl::OkStatus();

  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot read random bytes for an id: ", std::strerror(errno)));
  }
  while (got < n) {
    const ssize_t r = read(fd, buf + got, n - got);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      const int err = r < 0 ? errno : EIO;
      close(fd);
      return absl::InternalError(
          absl::StrCat("cannot read /dev/urandom for an id: ", std::strerror(err)));
    }
  }
  close(fd);
  return absl::OkStatus();
}

constexpr size_t kMaxInstanceNameChars = 63;  // a DNS label

bool IsInstanceName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxInstanceNameChars) return false;
  if (name.front() == '-' || name.back() == '-') return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

// `instance`: this table's instance name, which its ids must start with ("" = none).
absl::Status MalformedIdError(absl::string_view id, absl::string_view instance) {
  const bool truncated = id.size() > kMaxEchoedIdChars;
  const std::string expected =
      instance.empty()
          ? "32 lowercase hex characters"
          : absl::StrCat("\"", instance, ".\" followed by 32 lowercase hex characters");
  return absl::InvalidArgumentError(absl::StrCat("sequence_id must be ", expected, ", got \"",
                                                 absl::CHexEscape(id.substr(0, kMaxEchoedIdChars)),
                                                 truncated ? "...\"" : "\"", " (", id.size(),
                                                 " characters)"));
}

// One message for "never existed", "released" and "someone else's": callers must not be able to
// probe for other tenants' ids.
absl::Status SequenceNotFound(absl::string_view id) {
  return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
}

}  // namespace

absl::StatusOr<std::string> NewRandomId() {
  unsigned char bytes[kIdBytes];
  absl::Status s = FillRandom(bytes, sizeof(bytes));
  if (!s.ok()) return s;
  // BytesToHexString emits lowercase, the only spelling IsWellFormedId accepts.
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status CheckInstanceName(absl::string_view name) {
  if (name.empty() || IsInstanceName(name)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the instance name must be a DNS label: 1 to 63 characters of a-z, 0-9 and '-', not starting "
      "or ending with '-' (e.g. a StatefulSet pod name), got \"",
      absl::CHexEscape(name.substr(0, kMaxEchoedIdChars)),
      name.size() > kMaxEchoedIdChars ? "...\"" : "\"", " (", name.size(), " characters)"));
}

SequenceTable::SequenceTable(const SequenceTableOptions& options, PageAllocator* allocator)
    : options_(options), allocator_(allocator) {}

absl::Status SequenceTable::CheckId(absl::string_view id) const {
  const std::string& self = options_.instance_name;
  const size_t dot = id.find('.');
  if (dot == absl::string_view::npos) {
    if (self.empty() && IsWellFormedId(id)) return absl::OkStatus();
    return MalformedIdError(id, self);
  }
  const absl::string_view owner = id.substr(0, dot);
  if (!IsInstanceName(owner) || !IsWellFormedId(id.substr(dot + 1))) {
    return MalformedIdError(id, self);
  }
  if (owner == self) return absl::OkStatus();
  // Well formed, so short and printable: echoed whole.
  return absl::FailedPreconditionError(
      absl::StrCat("sequence ", id, " is owned by attnd instance \"", owner, "\" (",
                   self.empty() ? std::string("this daemon has no instance name")
                                : absl::StrCat("this is \"", self, "\""),
                   "); send calls for it to that instance"));
}

bool SequenceTable::IsWellFormedId(absl::string_view id) {
  if (id.size() != kIdChars) return false;
  for (char c : id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Create(absl::string_view tenant) {
  absl::StatusOr<std::string> random = NewRandomId();
  if (!random.ok()) return random.status();
  std::string id = options_.instance_name.empty()
                       ? *std::move(random)
                       : absl::StrCat(options_.instance_name, ".", *random);
  auto seq = std::make_shared<Sequence>(std::move(id), std::string(tenant), options_.num_layers);
  {
    // Nobody else can see seq yet; the lock only satisfies the annotations.
    MutexLock seq_lock(&seq->mu);
    seq->last_used = absl::Now();
  }
  MutexLock lock(&mu_);
  if (options_.max_sequences > 0 &&
      static_cast<int64_t>(sequences_.size()) >= options_.max_sequences) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many live sequences: the limit is ", options_.max_sequences, "; release one first"));
  }
  int64_t& mine = tenant_sequences_[seq->tenant];
  if (options_.tenant_max_sequences > 0 && mine >= options_.tenant_max_sequences) {
    if (mine == 0) tenant_sequences_.erase(seq->tenant);
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant \"", seq->tenant, "\" holds ", mine, " live sequences; quota ",
                     options_.tenant_max_sequences,
                     " (SequenceTableOptions::tenant_max_sequences): release one first"));
  }
  // A collision of 128 random bits does not happen; if the CSPRNG were broken it would, and
  // silently replacing a live sequence would hand one client another's K/V.
  if (!sequences_.emplace(seq->id, seq).second) {
    if (mine == 0) tenant_sequences_.erase(seq->tenant);
    return absl::InternalError("sequence id collision: the random source is not random");
  }
  ++mine;
  return seq;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Find(absl::string_view id,
                                                              absl::string_view tenant) const {
  if (absl::Status s = CheckId(id); !s.ok()) return s;
  MutexLock lock(&mu_);
  auto it = sequences_.find(id);
  if (it == sequences_.end() || it->second->tenant != tenant) return SequenceNotFound(id);
  return it->second;
}

absl::StatusOr<int64_t> SequenceTable::Release(absl::string_view id, absl::string_view tenant) {
  if (absl::Status s = CheckId(id); !s.ok()) return s;
  std::shared_ptr<Sequence> seq;
  {
    MutexLock lock(&mu_);
    auto it = sequences_.find(id);
    if (it == sequences_.end() || it->second->tenant != tenant) return SequenceNotFound(id);
    seq = EraseLocked(it);
  }
  // Outside the table lock: waiting here for a long request on this sequence must not stall
  // every other lookup. Once the id is out of the map nobody new can find it; a request that found
  // it earlier sees `released` when it gets the lock.
  MutexLock seq_lock(&seq->mu);
  return FreeAllLocked(seq.get());
}

std::shared_ptr<Sequence> SequenceTable::EraseLocked(
    absl::flat_hash_map<std::string, std::shared_ptr<Sequence>>::iterator it) {
  std::shared_ptr<Sequence> seq = std::move(it->second);
  sequences_.erase(it);
  auto count = tenant_sequences_.find(seq->tenant);
  if (count != tenant_sequences_.end() && --count->second <= 0) tenant_sequences_.erase(count);
  return seq;
}

int64_t SequenceTable::TenantSequences(absl::string_view tenant) const {
  MutexLock lock(&mu_);
  auto it = tenant_sequences_.find(tenant);
  return it == tenant_sequences_.end() ? 0 : it->second;
}

std::vector<SequenceTable::Listing> SequenceTable::List(absl::string_view tenant,
                                                        bool all_tenants) const {
  std::vector<std::shared_ptr<Sequence>> picked;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, seq] : sequences_) {
      if (all_tenants || seq->tenant == tenant) picked.push_back(seq);
    }
  }
  std::vector<Listing> out;
  out.reserve(picked.size());
  for (const std::shared_ptr<Sequence>& seq : picked) {
    MutexLock lock(&seq->mu);
    if (seq->released) continue;
    out.push_back(Listing{seq->id, seq->tenant, static_cast<int64_t>(seq->pages.size()),
                          seq->layer_lengths, seq->last_used});
  }
  return out;
}

int64_t SequenceTable::FreeAllLocked(Sequence* seq) {
  const int64_t freed = static_cast<int64_t>(seq->pages.size());
  allocator_->Free(seq->pages);
  seq->pages.clear();
  seq->pages.shrink_to_fit();
  seq->released = true;
  UncountPages(seq->tenant, freed);
  return freed;
}

void SequenceTable::UncountPages(const std::string& tenant, int64_t pages) {
  if (pages <= 0) return;
  MutexLock lock(&tenant_mu_);
  auto it = tenant_pages_.find(tenant);
  if (it == tenant_pages_.end()) return;
  it->second -= pages;
  if (it->second <= 0) tenant_pages_.erase(it);
}

int64_t SequenceTable::TenantPages(absl::string_view tenant) const {
  MutexLock lock(&tenant_mu_);
  auto it = tenant_pages_.find(tenant);
  return it == tenant_pages_.end() ? 0 : it->second;
}

absl::StatusOr<ReclaimedSequence> SequenceTable::ReleaseIfIdle(absl::string_view id,
                                                               absl::Time cutoff)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {  // (TryLock, then the lock is released on every path)
  std::shared_ptr<Sequence> seq;
  {
    MutexLock lock(&mu_);
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return SequenceNotFound(id);
    // TryLock under the table lock cannot deadlock (it never waits); holding both makes "still
    // idle" and "out of the map" one step, so a request cannot slip in between.
    if (!it->second->mu.TryLock()) {
      return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " is busy"));
    }
    if (it->second->released || it->second->last_used >= cutoff) {
      it->second->mu.Unlock();
      return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " was used recently"));
    }
    seq = EraseLocked(it);
  }
  ReclaimedSequence out;
  out.id = seq->id;
  out.tenant = seq->tenant;
  out.last_used = seq->last_used;
  out.pages_freed = FreeAllLocked(seq.get());
  seq->mu.Unlock();
  return out;
}

absl::StatusOr<int64_t> SequenceTable::EnsureCapacity(Sequence* seq, int64_t length) {
  if (seq->released) return SequenceNotFound(seq->id);  // its pages would never be freed
  if (length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence length must be non-negative, got ", length));
  }
  const int64_t page_size = options_.page_size;
  const int64_t pages_needed = length / page_size + (length % page_size != 0 ? 1 : 0);
  const int64_t have = static_cast<int64_t>(seq->pages.size());
  if (pages_needed <= have) return 0;
  const int64_t more = pages_needed - have;
  const int64_t quota = options_.tenant_page_quota;
  if (quota > 0) {
    // Check and count in one step, so concurrent requests of one tenant cannot both pass.
    MutexLock lock(&tenant_mu_);
    int64_t& held = tenant_pages_[seq->tenant];
    if (held + more > quota) {
      const int64_t held_now = held;
      if (held == 0) tenant_pages_.erase(seq->tenant);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot back ", length, " tokens of sequence ", seq->id, " (", more,
                       " more pages of ", page_size, " tokens): tenant \"", seq->tenant,
                       "\" holds ", held_now, " pages; quota ", quota));
    }
    held += more;
  } else {
    MutexLock lock(&tenant_mu_);
    tenant_pages_[seq->tenant] += more;
  }
  absl::StatusOr<std::vector<int32_t>> pages = allocator_->Allocate(more);
  if (!pages.ok()) {
    UncountPages(seq->tenant, more);
    // The allocator's message says how many pages were needed and how many are free; add what
    // for, so the client can tell a long request from a full server.
    return absl::Status(pages.status().code(),
                        absl::StrCat("cannot back ", length, " tokens of sequence ", seq->id, " (",
                                     pages_needed, " pages of ", page_size, " tokens, ", have,
                                     " held): ", pages.status().message()));
  }
  seq->pages.insert(seq->pages.end(), pages->begin(), pages->end());
  return more;
}

absl::StatusOr<PageReservation> SequenceTable::Reserve(Sequence* seq, int64_t length) {
  absl::StatusOr<int64_t> added = EnsureCapacity(seq, length);
  if (!added.ok()) return added.status();
  return PageReservation(this, seq, *added);
}

PageReservation::PageReservation(PageReservation&& other) noexcept
    : table_(other.table_), seq_(other.seq_), pages_(other.pages_) {
  other.table_ = nullptr;
}

PageReservation& PageReservation::operator=(PageReservation&& other) noexcept {
  if (this != &other) {
    Undo();
    table_ = other.table_;
    seq_ = other.seq_;
    pages_ = other.pages_;
    other.table_ = nullptr;
  }
  return *this;
}

PageReservation::~PageReservation() { Undo(); }

// The analysis cannot see that the owner of a reservation holds seq_->mu (the class comment's
// rule: a reservation ends inside the lock's scope).
void PageReservation::Undo() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (table_ == nullptr) return;
  table_->Rollback(seq_, pages_);
  table_ = nullptr;
}

SequenceLockSet::SequenceLockSet(absl::Span<const std::shared_ptr<Sequence>> seqs)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  for (const std::shared_ptr<Sequence>& seq : seqs) locked_.push_back(seq.get());
  std::sort(locked_.begin(), locked_.end(),
            [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
  for (Sequence* seq : locked_) seq->mu.Lock();
}

SequenceLockSet::~SequenceLockSet() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  for (auto it = locked_.rbegin(); it != locked_.rend(); ++it) (*it)->mu.Unlock();
}

std::optional<std::pair<size_t, size_t>> SequenceLockSet::FirstRepeat(
    absl::Span<const std::shared_ptr<Sequence>> seqs) {
  std::vector<size_t> order(seqs.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return seqs[a]->id < seqs[b]->id; });
  for (size_t i = 1; i < order.size(); ++i) {
    if (seqs[order[i]]->id == seqs[order[i - 1]]->id) {
      return std::make_pair(std::min(order[i], order[i - 1]), std::max(order[i], order[i - 1]));
    }
  }
  return std::nullopt;
}

void SequenceTable::Rollback(Sequence* seq, int64_t pages_added) {
  const int64_t have = static_cast<int64_t>(seq->pages.size());
  const int64_t n = pages_added < 0 ? 0 : (pages_added > have ? have : pages_added);
  if (n == 0) return;
  allocator_->Free(absl::MakeConstSpan(seq->pages).subspan(have - n));
  seq->pages.resize(have - n);
  UncountPages(seq->tenant, n);
}

int64_t SequenceTable::size() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(sequences_.size());
}

std::vector<std::string> SequenceTable::IdleSince(absl::Time cutoff) const {
  // Copy the pointers out first: a caller may hold some sequence's lock while calling Find, so
  // taking sequence locks under the table lock could deadlock.
  std::vector<std::shared_ptr<Sequence>> all;
  {
    MutexLock lock(&mu_);
    all.reserve(sequences_.size());
    for (const auto& entry : sequences_) all.push_back(entry.second);
  }
  std::vector<std::string> idle;
  for (const auto& seq : all) {
    // A sequence whose lock is held has a request in flight: it is not idle, and waiting for it
    // would stall the reaper behind the longest prefill.
    if (!seq->mu.TryLock()) continue;
    const bool is_idle = !seq->released && seq->last_used < cutoff;
    seq->mu.Unlock();
    if (is_idle) idle.push_back(seq->id);
  }
  return idle;
}

}  // namespace attnd
