// Live sequences: ids, owning tenant, the pages each holds and each layer's length.
#ifndef ATTND_KVCACHE_SEQUENCE_TABLE_H_
#define ATTND_KVCACHE_SEQUENCE_TABLE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"
#include "kvcache/page_allocator.h"

namespace attnd {

// 128 bits from the kernel's CSPRNG as 32 lowercase hex characters: the id of sequences and of
// tensor regions (unguessable, so an id is a capability). SequenceTable::IsWellFormedId checks one.
// A sequence of a named instance (SequenceTableOptions::instance_name) has "<instance>." before it.
absl::StatusOr<std::string> NewRandomId();

// OK for "" (no instance name) or a DNS label: 1 to 63 of [a-z0-9-], not starting or ending with
// '-' (what a Kubernetes StatefulSet pod name is); INVALID_ARGUMENT naming --instance-name if not.
absl::Status CheckInstanceName(absl::string_view name);

// One live sequence. Lock `mu` for every access; whoever holds it may read and write the K/V in the
// sequence's pages (one request at a time per sequence, so compute never races an append).
struct Sequence {
  Sequence(std::string id_in, std::string tenant_in, int32_t num_layers)
      : id(std::move(id_in)),
        tenant(std::move(tenant_in)),
        layer_lengths(num_layers, 0),
        layer_prompt_lens(num_layers, 0) {}

  const std::string id;      // [<instance>.]<32 lowercase hex characters (128 random bits)>
  const std::string tenant;  // who created it; "" when auth is off

  Mutex mu;
  std::vector<int32_t> pages ABSL_GUARDED_BY(mu);          // page i holds positions [i*P, (i+1)*P)
  std::vector<int64_t> layer_lengths ABSL_GUARDED_BY(mu);  // tokens cached per layer
  // Per layer, the prompt_len of a prompt still being prefilled in chunks (its length is below
  // it); 0 when none is. Every chunk of one prompt must carry the same prompt_len.
  std::vector<int64_t> layer_prompt_lens ABSL_GUARDED_BY(mu);
  bool released ABSL_GUARDED_BY(mu) = false;  // set once; a released sequence is dead
  absl::Time last_used ABSL_GUARDED_BY(mu) = absl::InfinitePast();
};

struct SequenceTableOptions {
  int32_t num_layers = 0;
  int32_t page_size = 0;
  int64_t max_sequences = 0;  // 0 = unlimited
  // Most pages the sequences of one tenant may hold together; 0 = unlimited. Tenant "" (auth off)
  // is a tenant like any other, so with auth off this caps every client together.
  int64_t tenant_page_quota = 0;
  // Most live sequences of one tenant, empty ones included; 0 = unlimited. Empty sequences hold no
  // pages, so without this one tenant could take every max_sequences slot and lock others out.
  int64_t tenant_max_sequences = 0;
  // This daemon's name in a fleet (CheckInstanceName): "" = ids are 32 hex characters as ever;
  // else "<instance_name>.<32 hex>", so an id names the daemon that owns it, and a call for
  // another instance's sequence fails FAILED_PRECONDITION naming its owner (CheckId).
  std::string instance_name;
};

// A sequence the idle reaper released.
struct ReclaimedSequence {
  std::string id;
  std::string tenant;
  int64_t pages_freed = 0;
  absl::Time last_used;
};

class SequenceTable;

// Pages reserved for one request on one sequence whose lock the caller holds: given back when the
// reservation is destroyed, unless Commit() said the request succeeded. So every early return of
// a request undoes its reservation, and only the success path keeps it. Destroy it (or commit it)
// while still holding the sequence's lock: declare it after the lock. Move-only.
class PageReservation {
 public:
  PageReservation() = default;
  PageReservation(PageReservation&& other) noexcept;
  PageReservation& operator=(PageReservation&& other) noexcept;
  PageReservation(const PageReservation&) = delete;
  PageReservation& operator=(const PageReservation&) = delete;
  ~PageReservation();

  int64_t pages_added() const { return pages_; }
  // The request succeeded: the pages stay with the sequence.
  void Commit() { table_ = nullptr; }

 private:
  friend class SequenceTable;
  PageReservation(SequenceTable* table, Sequence* seq, int64_t pages)
      : table_(table), seq_(seq), pages_(pages) {}
  void Undo();

  SequenceTable* table_ = nullptr;  // null once committed, moved from, or given back
  Sequence* seq_ = nullptr;
  int64_t pages_ = 0;
};

// The locks of several distinct sequences, taken in id order (two sets that share sequences then
// never wait on each other in a cycle) and released in reverse order on destruction. The caller
// makes sure no sequence appears twice (FirstRepeat). Not copyable or movable: it lives in the
// scope it locks.
class SequenceLockSet {
 public:
  explicit SequenceLockSet(absl::Span<const std::shared_ptr<Sequence>> seqs);
  ~SequenceLockSet();
  SequenceLockSet(const SequenceLockSet&) = delete;
  SequenceLockSet& operator=(const SequenceLockSet&) = delete;

  // Positions (a < b) of the first two entries naming one sequence, in id order; nullopt when all
  // are distinct.
  static std::optional<std::pair<size_t, size_t>> FirstRepeat(
      absl::Span<const std::shared_ptr<Sequence>> seqs);

 private:
  std::vector<Sequence*> locked_;  // in id order
};

// Thread-safe. Pages come from (and go back to) the allocator given at construction.
class SequenceTable {
 public:
  SequenceTable(const SequenceTableOptions& options, PageAllocator* allocator);

  // A new empty sequence owned by `tenant`, its id 128 bits from the OS CSPRNG, last_used = now;
  // RESOURCE_EXHAUSTED past max_sequences or the tenant's tenant_max_sequences; INTERNAL if the OS
  // has no randomness to give.
  absl::StatusOr<std::shared_ptr<Sequence>> Create(absl::string_view tenant);
  // OK when `id` has the form this table issues. FAILED_PRECONDITION when it is well formed but
  // names another instance ("<other>.<32 hex>"): "sequence ID is owned by attnd instance "other"
  // (this is "self"); send calls for it to that instance". INVALID_ARGUMENT when it is malformed,
  // and for a bare 32-hex id on a named instance (no id this daemon issued looks like that).
  absl::Status CheckId(absl::string_view id) const;
  // Errors of CheckId; NOT_FOUND for an unknown id or another tenant's sequence (the message is
  // the same either way: no existence oracle).
  absl::StatusOr<std::shared_ptr<Sequence>> Find(absl::string_view id,
                                                 absl::string_view tenant) const;
  // Removes the sequence and frees its pages (waiting for a request in flight on it: it locks
  // seq->mu), and marks it released; returns the number of pages freed. Errors as Find. Callers
  // holding a Sequence from an earlier Find must check `released` after locking it.
  absl::StatusOr<int64_t> Release(absl::string_view id, absl::string_view tenant);

  // Grows seq's pages so positions [0, length) are backed, all or nothing; returns how many pages
  // were added (0 if none were needed), or RESOURCE_EXHAUSTED with nothing changed (the message
  // says how many pages were needed and how many are free). NOT_FOUND for a released sequence.
  // When seq's tenant would pass tenant_page_quota: RESOURCE_EXHAUSTED "... tenant T holds N
  // pages; quota Q", nothing changed.
  absl::StatusOr<int64_t> EnsureCapacity(Sequence* seq, int64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);
  // EnsureCapacity, as a reservation that gives the pages back unless committed.
  absl::StatusOr<PageReservation> Reserve(Sequence* seq, int64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);
  // Gives back the last `pages_added` pages of seq (undoes EnsureCapacity after a failed request).
  void Rollback(Sequence* seq, int64_t pages_added) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);

  int64_t size() const;
  // Ids of sequences last used before `cutoff` (for idle reclaim). A sequence whose lock is held
  // right now is busy, hence not idle, and is skipped without waiting. Callers update last_used.
  std::vector<std::string> IdleSince(absl::Time cutoff) const;
  // Releases sequence `id` (any tenant) only if it is still idle: not locked right now (checked
  // without waiting), not released, last used before `cutoff`. Closes the race between IdleSince
  // and a request that used the sequence since. NOT_FOUND when gone; FAILED_PRECONDITION when busy
  // or used since the cutoff.
  absl::StatusOr<ReclaimedSequence> ReleaseIfIdle(absl::string_view id, absl::Time cutoff);

  // Pages held by `tenant`'s sequences now.
  int64_t TenantPages(absl::string_view tenant) const;
  // Live sequences of `tenant` now.
  int64_t TenantSequences(absl::string_view tenant) const;
  // What one tenant's sequences hold: id, pages, per-layer lengths, last use (for operators).
  struct Listing {
    std::string id;
    std::string tenant;
    int64_t pages = 0;
    std::vector<int64_t> layer_lengths;
    absl::Time last_used;
  };
  // Every live sequence of `tenant`, or of every tenant when `all_tenants`. A sequence busy right
  // now is listed with what it held when its request began (its lock is waited for briefly).
  std::vector<Listing> List(absl::string_view tenant, bool all_tenants) const;

  // 32 lowercase hex characters: a region id, or a sequence id without its instance prefix.
  static bool IsWellFormedId(absl::string_view id);

 private:
  const SequenceTableOptions options_;
  PageAllocator* const allocator_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int64_t> tenant_sequences_ ABSL_GUARDED_BY(mu_);
  // Pages held per tenant. Its own lock, taken last (under a sequence's lock, never the reverse).
  mutable Mutex tenant_mu_;
  absl::flat_hash_map<std::string, int64_t> tenant_pages_ ABSL_GUARDED_BY(tenant_mu_);

  // Frees seq's pages, marks it released and uncounts its pages from its tenant.
  int64_t FreeAllLocked(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);
  void UncountPages(const std::string& tenant, int64_t pages);
  // Removes `it` from sequences_ and uncounts it from its tenant.
  std::shared_ptr<Sequence> EraseLocked(
      absl::flat_hash_map<std::string, std::shared_ptr<Sequence>>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace attnd

#endif  // ATTND_KVCACHE_SEQUENCE_TABLE_H_
