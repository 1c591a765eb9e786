#include "kvcache/sequence_table.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/page_allocator.h"

namespace attnd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

constexpr int32_t kPageSize = 16;

SequenceTableOptions Options(int64_t max_sequences = 0) {
  SequenceTableOptions o;
  o.num_layers = 3;
  o.page_size = kPageSize;
  o.max_sequences = max_sequences;
  return o;
}

std::shared_ptr<Sequence> MustCreate(SequenceTable& table, absl::string_view tenant) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = table.Create(tenant);
  EXPECT_TRUE(seq.ok()) << seq.status();
  return seq.ok() ? *seq : nullptr;
}

// Pages needed to back `length` tokens, counted rather than computed with a formula.
int64_t PagesByCounting(int64_t length) {
  int64_t pages = 0;
  while (pages * kPageSize < length) ++pages;
  return pages;
}

std::vector<int32_t> PagesOf(Sequence& seq) {
  MutexLock lock(&seq.mu);
  return seq.pages;
}

TEST(SequenceTableTest, IdsAre32LowercaseHexAndDistinct) {
  PageAllocator alloc(8);
  SequenceTable table(Options(), &alloc);
  std::set<std::string> ids;
  for (int i = 0; i < 200; ++i) {
    std::shared_ptr<Sequence> seq = MustCreate(table, "");
    ASSERT_NE(seq, nullptr);
    ASSERT_EQ(seq->id.size(), 32u);
    for (char c : seq->id) {
      ASSERT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << seq->id;
    }
    ids.insert(seq->id);
  }
  EXPECT_EQ(ids.size(), 200u);
  EXPECT_EQ(table.size(), 200);
}

TEST(SequenceTableTest, IdsLookRandom) {
  // 128 random bits per id: over 256 ids every hex digit appears in every position with
  // overwhelming probability; a counter or timestamp-based id would leave most positions fixed.
  PageAllocator alloc(1);
  SequenceTable table(Options(), &alloc);
  std::vector<std::set<char>> digits(32);
  for (int i = 0; i < 256; ++i) {
    std::shared_ptr<Sequence> seq = MustCreate(table, "");
    ASSERT_NE(seq, nullptr);
    for (int j = 0; j < 32; ++j) digits[j].insert(seq->id[j]);
  }
  for (int j = 0; j < 32; ++j) EXPECT_GE(digits[j].size(), 12u) << "position " << j;
}

TEST(SequenceTableTest, NewSequenceIsEmpty) {
  PageAllocator alloc(8);
  SequenceTable table(Options(), &alloc);
  const absl::Time before = absl::Now();
  std::shared_ptr<Sequence> seq = MustCreate(table, "alice");
  ASSERT_NE(seq, nullptr);
  MutexLock lock(&seq->mu);
  EXPECT_EQ(seq->tenant, "alice");
  EXPECT_THAT(seq->pages, IsEmpty());
  EXPECT_THAT(seq->layer_lengths, ElementsAre(0, 0, 0));
  EXPECT_FALSE(seq->released);
  EXPECT_GE(seq->last_used, before);
  EXPECT_LE(seq->last_used, absl::Now());
}

TEST(SequenceTableTest, IsWellFormedId) {
  EXPECT_TRUE(SequenceTable::IsWellFormedId("0123456789abcdef0123456789abcdef"));
  EXPECT_FALSE(SequenceTable::IsWellFormedId("0123456789ABCDEF0123456789abcdef"));   // uppercase
  EXPECT_FALSE(SequenceTable::IsWellFormedId("0123456789abcdef0123456789abcde"));    // 31
  EXPECT_FALSE(SequenceTable::IsWellFormedId("0123456789abcdef0123456789abcdef0"));  // 33
  EXPECT_FALSE(SequenceTable::IsWellFormedId("0123456789abcdef0123456789abcdeg"));   // 'g'
  EXPECT_FALSE(SequenceTable::IsWellFormedId(""));
  EXPECT_FALSE(SequenceTable::IsWellFormedId(std::string(32, '\0')));
}

SequenceTableOptions Named(absl::string_view instance) {
  SequenceTableOptions o = Options();
  o.instance_name = std::string(instance);
  return o;
}

TEST(SequenceTableTest, CheckInstanceName) {
  EXPECT_TRUE(CheckInstanceName("").ok());  // unnamed: ids as ever
  EXPECT_TRUE(CheckInstanceName("attnd-0").ok());
  EXPECT_TRUE(CheckInstanceName("a").ok());
  EXPECT_TRUE(CheckInstanceName("0").ok());
  EXPECT_TRUE(CheckInstanceName(std::string(63, 'z')).ok());
  const absl::Status too_long = CheckInstanceName(std::string(64, 'z'));
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      too_long.message(),
      absl::StrCat("the instance name must be a DNS label: 1 to 63 characters of a-z, 0-9 and "
                   "'-', not starting or ending with '-' (e.g. a StatefulSet pod name), got "
                   "\"",
                   std::string(64, 'z'), "\" (64 characters)"));
  for (const char* bad : {"-a", "a-", "Attnd-0", "attnd.0", "attnd_0", "a b", "\n"}) {
    const absl::Status s = CheckInstanceName(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()),
                ::testing::HasSubstr("the instance name must be a DNS label"))
        << bad;
  }
  EXPECT_THAT(std::string(CheckInstanceName("a.b").message()),
              ::testing::EndsWith("got \"a.b\" (3 characters)"));
}

TEST(SequenceTableTest, NamedInstanceIssuesPrefixedIds) {
  PageAllocator alloc(8);
  SequenceTable table(Named("attnd-1"), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "");
  ASSERT_EQ(seq->id.size(), 8u + 32u) << seq->id;
  EXPECT_EQ(seq->id.substr(0, 8), "attnd-1.");
  EXPECT_TRUE(SequenceTable::IsWellFormedId(seq->id.substr(8))) << seq->id;
  EXPECT_TRUE(table.CheckId(seq->id).ok());
  absl::StatusOr<std::shared_ptr<Sequence>> found = table.Find(seq->id, "");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->get(), seq.get());
  // Unnamed tables issue the bare form, unchanged.
  SequenceTable bare(Options(), &alloc);
  std::shared_ptr<Sequence> plain = MustCreate(bare, "");
  EXPECT_TRUE(SequenceTable::IsWellFormedId(plain->id)) << plain->id;
}

TEST(SequenceTableTest, AnotherInstancesIdIsFailedPreconditionNamingTheOwner) {
  PageAllocator alloc(8);
  SequenceTable table(Named("attnd-1"), &alloc);
  const std::string foreign = "attnd-2.0123456789abcdef0123456789abcdef";
  const std::string want =
      "sequence attnd-2.0123456789abcdef0123456789abcdef is owned by attnd instance \"attnd-2\" "
      "(this is \"attnd-1\"); send calls for it to that instance";
  absl::Status s = table.CheckId(foreign);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), want);
  absl::StatusOr<std::shared_ptr<Sequence>> found = table.Find(foreign, "");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(found.status().message(), want);
  absl::StatusOr<int64_t> released = table.Release(foreign, "");
  EXPECT_EQ(released.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(released.status().message(), want);

  // A daemon with no name cannot own a prefixed id either.
  SequenceTable bare(Options(), &alloc);
  s = bare.CheckId(foreign);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "sequence attnd-2.0123456789abcdef0123456789abcdef is owned by attnd instance "
            "\"attnd-2\" (this daemon has no instance name); send calls for it to that instance");
  EXPECT_EQ(bare.Release(foreign, "").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SequenceTableTest, NamedInstanceRejectsBareAndMalformedIds) {
  PageAllocator alloc(8);
  SequenceTable table(Named("attnd-1"), &alloc);
  // A bare id is no id this daemon issued: malformed here, not "not found".
  absl::Status s = table.CheckId("0123456789abcdef0123456789abcdef");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "sequence_id must be \"attnd-1.\" followed by 32 lowercase hex characters, got "
            "\"0123456789abcdef0123456789abcdef\" (32 characters)");
  for (const char* bad :
       {"attnd-1.", "attnd-1.0123456789abcdef0123456789abcde",  // 31 hex
        "attnd-1.0123456789ABCDEF0123456789abcdef", ".0123456789abcdef0123456789abcdef",
        "-x.0123456789abcdef0123456789abcdef", "attnd-2.0123456789abcdef0123456789abcdef.",
        "a.b.0123456789abcdef0123456789abcdef"}) {
    s = table.CheckId(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message(),
              absl::StrCat("sequence_id must be \"attnd-1.\" followed by 32 lowercase hex "
                           "characters, got \"",
                           bad, "\" (", std::string(bad).size(), " characters)"));
  }
  // An unnamed daemon keeps its message.
  SequenceTable bare(Options(), &alloc);
  EXPECT_EQ(bare.CheckId("attnd-1.xyz").message(),
            "sequence_id must be 32 lowercase hex characters, got \"attnd-1.xyz\" (11 characters)");
}

TEST(SequenceTableTest, FindReturnsTheSameSequence) {
  PageAllocator alloc(8);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "alice");
  absl::StatusOr<std::shared_ptr<Sequence>> found = table.Find(seq->id, "alice");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->get(), seq.get());
}

TEST(SequenceTableTest, FindRejectsMalformedIds) {
  PageAllocator alloc(8);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "");
  std::string upper = seq->id;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (upper == seq->id) upper[0] = 'G';  // all digits: make it malformed another way

  absl::StatusOr<std::shared_ptr<Sequence>> r = table.Find("xyz", "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "sequence_id must be 32 lowercase hex characters, got \"xyz\" (3 characters)");

  r = table.Find(upper, "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), absl::StrCat("sequence_id must be 32 lowercase hex characters, "
                                               "got \"",
                                               upper, "\" (32 characters)"));

  // Control bytes are escaped, and a huge id is not echoed whole.
  r = table.Find(std::string("a\nb"), "");
  EXPECT_EQ(r.status().message(),
            "sequence_id must be 32 lowercase hex characters, got \"a\\nb\" (3 characters)");
  r = table.Find(std::string(1000, 'a'), "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            absl::StrCat("sequence_id must be 32 lowercase hex characters, got \"",
                         std::string(64, 'a'), "...\" (1000 characters)"));
}

TEST(SequenceTableTest, UnknownAndOtherTenantsSequencesLookTheSame) {
  PageAllocator alloc(8);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> alices = MustCreate(table, "alice");
  const std::string unknown = "00000000000000000000000000000000";
  ASSERT_NE(alices->id, unknown);

  absl::StatusOr<std::shared_ptr<Sequence>> as_bob = table.Find(alices->id, "bob");
  absl::StatusOr<std::shared_ptr<Sequence>> no_auth = table.Find(alices->id, "");
  absl::StatusOr<std::shared_ptr<Sequence>> missing = table.Find(unknown, "alice");
  EXPECT_EQ(as_bob.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(no_auth.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(as_bob.status().message(), absl::StrCat("sequence ", alices->id, " not found"));
  EXPECT_EQ(no_auth.status().message(), absl::StrCat("sequence ", alices->id, " not found"));
  EXPECT_EQ(missing.status().message(), absl::StrCat("sequence ", unknown, " not found"));

  // Bob cannot release it either, and trying leaves it alive for Alice.
  absl::StatusOr<int64_t> released = table.Release(alices->id, "bob");
  EXPECT_EQ(released.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(released.status().message(), absl::StrCat("sequence ", alices->id, " not found"));
  EXPECT_TRUE(table.Find(alices->id, "alice").ok());
  EXPECT_EQ(table.size(), 1);
}

TEST(SequenceTableTest, CapacityGrowsAcrossPageBoundaries) {
  PageAllocator alloc(64);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "");
  MutexLock lock(&seq->mu);
  int64_t held = 0;
  // Every length from 0 to 10 pages, one token at a time: pages are added exactly when a length
  // crosses a page boundary (17, 33, ...), never earlier.
  for (int64_t length = 0; length <= 10 * kPageSize; ++length) {
    absl::StatusOr<int64_t> added = table.EnsureCapacity(seq.get(), length);
    ASSERT_TRUE(added.ok()) << added.status();
    const int64_t want = PagesByCounting(length);
    EXPECT_EQ(*added, want - held) << "length " << length;
    held = want;
    ASSERT_EQ(static_cast<int64_t>(seq->pages.size()), want) << "length " << length;
  }
  EXPECT_EQ(alloc.num_free(), 64 - 10);
  // Shrinking requests add nothing and free nothing.
  absl::StatusOr<int64_t> added = table.EnsureCapacity(seq.get(), 5);
  ASSERT_TRUE(added.ok());
  EXPECT_EQ(*added, 0);
  EXPECT_EQ(seq->pages.size(), 10u);
  EXPECT_EQ(std::set<int32_t>(seq->pages.begin(), seq->pages.end()).size(), 10u);
}

TEST(SequenceTableTest, CapacityJumpsSeveralPagesAtOnce) {
  PageAllocator alloc(64);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "");
  MutexLock lock(&seq->mu);
  absl::StatusOr<int64_t> added = table.EnsureCapacity(seq.get(), 3 * kPageSize + 1);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(*added, 4);
  added = table.EnsureCapacity(seq.get(), 7 * kPageSize);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(*added, 3);
  EXPECT_EQ(alloc.num_free(), 64 - 7);

  added = table.EnsureCapacity(seq.get(), -1);
  EXPECT_EQ(added.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(added.status().message(), "sequence length must be non-negative, got -1");
}

TEST(SequenceTableTest, EnsureCapacityIsAllOrNothing) {
  PageAllocator alloc(4);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> a = MustCreate(table, "");
  std::shared_ptr<Sequence> b = MustCreate(table, "");
  {
    MutexLock lock(&a->mu);
    ASSERT_TRUE(table.EnsureCapacity(a.get(), 2 * kPageSize).ok());
  }
  MutexLock lock(&b->mu);
  ASSERT_TRUE(table.EnsureCapacity(b.get(), 1).ok());
  const std::vector<int32_t> before = b->pages;

  // 100 tokens need 7 pages; b holds 1 and 2 are free: 6 more needed, so nothing is taken.
  absl::StatusOr<int64_t> added = table.EnsureCapacity(b.get(), 100);
  ASSERT_FALSE(added.ok());
  EXPECT_EQ(added.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(added.status().message(),
            absl::StrCat("cannot back 100 tokens of sequence ", b->id,
                         " (7 pages of 16 tokens, 1 held): out of KV cache pages: 6 needed, "
                         "1 free of 4"));
  EXPECT_EQ(b->pages, before);
  EXPECT_EQ(alloc.num_free(), 1);
  // What does fit still fits.
  added = table.EnsureCapacity(b.get(), 2 * kPageSize);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(*added, 1);
  EXPECT_EQ(alloc.num_free(), 0);
}

TEST(SequenceTableTest, RollbackReturnsTheAddedPages) {
  PageAllocator alloc(10);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "");
  MutexLock lock(&seq->mu);
  ASSERT_TRUE(table.EnsureCapacity(seq.get(), 20).ok());  // 2 pages
  const std::vector<int32_t> committed = seq->pages;
  absl::StatusOr<int64_t> added = table.EnsureCapacity(seq.get(), 60);  // 4 pages
  ASSERT_TRUE(added.ok());
  ASSERT_EQ(*added, 2);
  const std::vector<int32_t> tentative(seq->pages.begin() + 2, seq->pages.end());
  EXPECT_EQ(alloc.num_free(), 6);

  table.Rollback(seq.get(), *added);
  EXPECT_EQ(seq->pages, committed);
  EXPECT_EQ(alloc.num_free(), 8);
  // The rolled-back pages are the ones handed out next.
  absl::StatusOr<std::vector<int32_t>> next = alloc.Allocate(2);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(std::set<int32_t>(next->begin(), next->end()),
            std::set<int32_t>(tentative.begin(), tentative.end()));
  alloc.Free(*next);

  table.Rollback(seq.get(), 0);  // no-op
  EXPECT_EQ(seq->pages, committed);
  table.Rollback(seq.get(), 99);  // more than held: gives back what there is
  EXPECT_THAT(seq->pages, IsEmpty());
  EXPECT_EQ(alloc.num_free(), 10);
}

TEST(SequenceTableTest, AReservationGivesItsPagesBackUnlessCommitted) {
  PageAllocator alloc(10);
  SequenceTableOptions o = Options();
  o.tenant_page_quota = 10;
  SequenceTable table(o, &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "t");
  MutexLock lock(&seq->mu);
  {
    absl::StatusOr<PageReservation> kept = table.Reserve(seq.get(), 20);  // 2 pages
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_EQ(kept->pages_added(), 2);
    kept->Commit();
  }
  EXPECT_EQ(seq->pages.size(), 2u);
  EXPECT_EQ(table.TenantPages("t"), 2);
  {
    absl::StatusOr<PageReservation> dropped = table.Reserve(seq.get(), 60);  // 2 more
    ASSERT_TRUE(dropped.ok());
    EXPECT_EQ(dropped->pages_added(), 2);
    EXPECT_EQ(alloc.num_free(), 6);
    // Moved twice: only the last owner gives the pages back, once.
    PageReservation moved = *std::move(dropped);
    PageReservation again;
    again = std::move(moved);
    EXPECT_EQ(again.pages_added(), 2);
  }
  EXPECT_EQ(seq->pages.size(), 2u);
  EXPECT_EQ(alloc.num_free(), 8);
  EXPECT_EQ(table.TenantPages("t"), 2);
  {
    absl::StatusOr<PageReservation> none = table.Reserve(seq.get(), 30);  // already backed
    ASSERT_TRUE(none.ok());
    EXPECT_EQ(none->pages_added(), 0);
  }
  EXPECT_EQ(seq->pages.size(), 2u);
  absl::StatusOr<PageReservation> too_many = table.Reserve(seq.get(), 16 * 11);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(alloc.num_free(), 8);
}

TEST(SequenceTableTest, ALockSetHoldsEveryLockAndFindsRepeats) {
  PageAllocator alloc(4);
  SequenceTable table(Options(), &alloc);
  std::vector<std::shared_ptr<Sequence>> seqs = {MustCreate(table, ""), MustCreate(table, ""),
                                                 MustCreate(table, "")};
  EXPECT_EQ(SequenceLockSet::FirstRepeat(seqs), std::nullopt);
  {
    const SequenceLockSet locks(seqs);
    for (const auto& seq : seqs) {
      EXPECT_FALSE(seq->mu.TryLock()) << "not locked: " << seq->id;
    }
  }
  for (const auto& seq : seqs) {
    ASSERT_TRUE(seq->mu.TryLock()) << "still locked: " << seq->id;
    seq->mu.Unlock();
  }
  std::vector<std::shared_ptr<Sequence>> repeated = {seqs[2], seqs[0], seqs[1], seqs[0]};
  const auto repeat = SequenceLockSet::FirstRepeat(repeated);
  ASSERT_TRUE(repeat.has_value());
  EXPECT_EQ(*repeat, std::make_pair(size_t{1}, size_t{3}));
}

TEST(SequenceTableTest, ReleaseFreesEveryPageAndForgetsTheId) {
  PageAllocator alloc(10);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "alice");
  std::shared_ptr<Sequence> other = MustCreate(table, "alice");
  {
    MutexLock lock(&seq->mu);
    ASSERT_TRUE(table.EnsureCapacity(seq.get(), 5 * kPageSize - 3).ok());
  }
  {
    MutexLock lock(&other->mu);
    ASSERT_TRUE(table.EnsureCapacity(other.get(), 1).ok());
  }
  EXPECT_EQ(alloc.num_free(), 4);

  absl::StatusOr<int64_t> freed = table.Release(seq->id, "alice");
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 5);
  EXPECT_EQ(alloc.num_free(), 9);
  EXPECT_EQ(table.size(), 1);
  {
    MutexLock lock(&seq->mu);
    EXPECT_TRUE(seq->released);
    EXPECT_THAT(seq->pages, IsEmpty());
    // A request that found the sequence before the release cannot grow it again.
    absl::StatusOr<int64_t> added = table.EnsureCapacity(seq.get(), 1);
    EXPECT_EQ(added.status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(added.status().message(), absl::StrCat("sequence ", seq->id, " not found"));
  }
  EXPECT_EQ(alloc.num_free(), 9);

  const std::string gone = absl::StrCat("sequence ", seq->id, " not found");
  EXPECT_EQ(table.Find(seq->id, "alice").status().message(), gone);
  absl::StatusOr<int64_t> again = table.Release(seq->id, "alice");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.status().message(), gone);
  EXPECT_EQ(table.Release("nope", "alice").status().code(), absl::StatusCode::kInvalidArgument);

  // The other sequence is untouched.
  EXPECT_EQ(PagesOf(*other).size(), 1u);
  EXPECT_TRUE(table.Find(other->id, "alice").ok());
}

TEST(SequenceTableTest, ReleaseWaitsForTheRequestInFlight) {
  PageAllocator alloc(4);
  SequenceTable table(Options(), &alloc);
  std::shared_ptr<Sequence> seq = MustCreate(table, "");
  std::atomic<bool> release_returned{false};
  Notification locked;
  Notification finish;
  std::thread request([&] {
    MutexLock lock(&seq->mu);
    ASSERT_TRUE(table.EnsureCapacity(seq.get(), 40).ok());
    locked.Notify();
    finish.WaitForNotification();
  });
  locked.WaitForNotification();
  std::thread releaser([&] {
    absl::StatusOr<int64_t> freed = table.Release(seq->id, "");
    EXPECT_TRUE(freed.ok()) << freed.status();
    EXPECT_EQ(freed.value_or(-1), 3);
    release_returned = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(release_returned);  // still blocked on the in-flight request
  EXPECT_EQ(alloc.num_free(), 1);  // and its pages are still in use
  // Lookups are not stalled behind the waiting release: the id is already gone.
  EXPECT_EQ(table.Find(seq->id, "").status().code(), absl::StatusCode::kNotFound);
  finish.Notify();
  request.join();
  releaser.join();
  EXPECT_TRUE(release_returned);
  EXPECT_EQ(alloc.num_free(), 4);
}

TEST(SequenceTableTest, MaxSequences) {
  PageAllocator alloc(4);
  SequenceTable table(Options(/*max_sequences=*/2), &alloc);
  std::shared_ptr<Sequence> a = MustCreate(table, "");
  std::shared_ptr<Sequence> b = MustCreate(table, "x");
  absl::StatusOr<std::shared_ptr<Sequence>> c = table.Create("");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c.status().message(), "too many live sequences: the limit is 2; release one first");
  EXPECT_EQ(table.size(), 2);
  ASSERT_TRUE(table.Release(a->id, "").ok());
  c = table.Create("");
  EXPECT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(table.size(), 2);
}

TEST(SequenceTableTest, IdleSinceListsOnlyIdleUnlockedSequences) {
  PageAllocator alloc(4);
  SequenceTable table(Options(), &alloc);
  const absl::Time t0 = absl::FromUnixSeconds(1700000000);
  std::shared_ptr<Sequence> old1 = MustCreate(table, "a");
  std::shared_ptr<Sequence> old2 = MustCreate(table, "b");
  std::shared_ptr<Sequence> fresh = MustCreate(table, "a");
  std::shared_ptr<Sequence> busy = MustCreate(table, "a");
  for (auto& [seq, t] :
       std::vector<std::pair<Sequence*, absl::Time>>{{old1.get(), t0},
                                                     {old2.get(), t0 + absl::Seconds(9)},
                                                     {fresh.get(), t0 + absl::Seconds(10)},
                                                     {busy.get(), t0}}) {
    MutexLock lock(&seq->mu);
    seq->last_used = t;
  }
  const absl::Time cutoff = t0 + absl::Seconds(10);  // strictly before: `fresh` is not idle
  EXPECT_THAT(table.IdleSince(cutoff), UnorderedElementsAre(old1->id, old2->id, busy->id));
  {
    MutexLock lock(&busy->mu);  // a request in flight
    EXPECT_THAT(table.IdleSince(cutoff), UnorderedElementsAre(old1->id, old2->id));
  }
  ASSERT_TRUE(table.Release(old1->id, "a").ok());
  EXPECT_THAT(table.IdleSince(cutoff), UnorderedElementsAre(old2->id, busy->id));
  EXPECT_THAT(table.IdleSince(t0), IsEmpty());
}

TEST(SequenceTableTest, ReleaseIfIdleReleasesOnlyWhatIsStillIdle) {
  PageAllocator alloc(8);
  SequenceTable table(Options(), &alloc);
  const absl::Time t0 = absl::FromUnixSeconds(1700000000);
  const absl::Time cutoff = t0 + absl::Seconds(10);
  std::shared_ptr<Sequence> idle = MustCreate(table, "a");
  std::shared_ptr<Sequence> fresh = MustCreate(table, "b");
  std::shared_ptr<Sequence> busy = MustCreate(table, "a");
  for (auto& [seq, t] : std::vector<std::pair<Sequence*, absl::Time>>{
           {idle.get(), t0}, {fresh.get(), cutoff}, {busy.get(), t0}}) {
    MutexLock lock(&seq->mu);
    ASSERT_TRUE(table.EnsureCapacity(seq, 2 * kPageSize).ok());
    seq->last_used = t;
  }
  ASSERT_EQ(alloc.num_free(), 2);
  ASSERT_EQ(table.TenantPages("a"), 4);

  absl::StatusOr<ReclaimedSequence> r = table.ReleaseIfIdle(idle->id, cutoff);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->id, idle->id);
  EXPECT_EQ(r->tenant, "a");
  EXPECT_EQ(r->pages_freed, 2);
  EXPECT_EQ(r->last_used, t0);
  EXPECT_EQ(alloc.num_free(), 4);
  EXPECT_EQ(table.TenantPages("a"), 2);
  EXPECT_EQ(table.Find(idle->id, "a").status().code(), absl::StatusCode::kNotFound);
  {
    MutexLock lock(&idle->mu);
    EXPECT_TRUE(idle->released);
    EXPECT_THAT(idle->pages, IsEmpty());
  }
  // Gone now: the same answer as any unknown id.
  r = table.ReleaseIfIdle(idle->id, cutoff);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), absl::StrCat("sequence ", idle->id, " not found"));

  // Used at the cutoff (not before it): kept, pages untouched.
  r = table.ReleaseIfIdle(fresh->id, cutoff);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(), absl::StrCat("sequence ", fresh->id, " was used recently"));
  EXPECT_EQ(PagesOf(*fresh).size(), 2u);

  {
    MutexLock lock(&busy->mu);  // a request in flight
    r = table.ReleaseIfIdle(busy->id, cutoff);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(r.status().message(), absl::StrCat("sequence ", busy->id, " is busy"));
  }
  EXPECT_TRUE(table.Find(busy->id, "a").ok());
  EXPECT_EQ(table.size(), 2);
  EXPECT_EQ(alloc.num_free(), 4);
}

SequenceTableOptions QuotaOptions(int64_t quota) {
  SequenceTableOptions o = Options();
  o.tenant_page_quota = quota;
  return o;
}

TEST(SequenceTableTest, TenantQuotaRejectsWithNothingChanged) {
  PageAllocator alloc(16);
  SequenceTable table(QuotaOptions(4), &alloc);
  std::shared_ptr<Sequence> a1 = MustCreate(table, "a");
  std::shared_ptr<Sequence> a2 = MustCreate(table, "a");
  std::shared_ptr<Sequence> b1 = MustCreate(table, "b");
  {
    MutexLock lock(&a1->mu);
    absl::StatusOr<int64_t> added = table.EnsureCapacity(a1.get(), 3 * kPageSize);
    ASSERT_TRUE(added.ok()) << added.status();
    EXPECT_EQ(*added, 3);
  }
  EXPECT_EQ(table.TenantPages("a"), 3);
  {
    MutexLock lock(&a2->mu);
    ASSERT_TRUE(table.EnsureCapacity(a2.get(), 1).ok());  // the 4th page: exactly the quota
    const std::vector<int32_t> before = a2->pages;
    absl::StatusOr<int64_t> added = table.EnsureCapacity(a2.get(), kPageSize + 1);
    ASSERT_FALSE(added.ok());
    EXPECT_EQ(added.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(added.status().message(),
              absl::StrCat("cannot back 17 tokens of sequence ", a2->id,
                           " (1 more pages of 16 tokens): tenant \"a\" holds 4 pages; quota 4"));
    EXPECT_EQ(a2->pages, before);
  }
  EXPECT_EQ(table.TenantPages("a"), 4);
  EXPECT_EQ(alloc.num_free(), 12);

  // Another tenant has its own quota, even with the pool far from full.
  {
    MutexLock lock(&b1->mu);
    ASSERT_TRUE(table.EnsureCapacity(b1.get(), 4 * kPageSize).ok());
    absl::StatusOr<int64_t> added = table.EnsureCapacity(b1.get(), 5 * kPageSize);
    EXPECT_EQ(added.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(added.status().message()),
                ::testing::HasSubstr("tenant \"b\" holds 4 pages; quota 4"));
    // Rollback uncounts.
    table.Rollback(b1.get(), 2);
  }
  EXPECT_EQ(table.TenantPages("b"), 2);
  EXPECT_EQ(alloc.num_free(), 10);

  // Releasing gives the quota back.
  absl::StatusOr<int64_t> freed = table.Release(a1->id, "a");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 3);
  EXPECT_EQ(table.TenantPages("a"), 1);
  MutexLock lock(&a2->mu);
  absl::StatusOr<int64_t> added = table.EnsureCapacity(a2.get(), 4 * kPageSize);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(*added, 3);
  EXPECT_EQ(table.TenantPages("a"), 4);
}

TEST(SequenceTableTest, TenantQuotaHoldsUnderConcurrentGrowth) {
  PageAllocator alloc(64);
  SequenceTable table(QuotaOptions(10), &alloc);
  std::vector<std::shared_ptr<Sequence>> seqs;
  for (int i = 0; i < 8; ++i) seqs.push_back(MustCreate(table, "a"));
  std::atomic<int64_t> granted{0};
  std::vector<std::thread> threads;
  for (auto& seq : seqs) {
    threads.emplace_back([&table, &granted, seq] {
      MutexLock lock(&seq->mu);
      absl::StatusOr<int64_t> added = table.EnsureCapacity(seq.get(), 3 * kPageSize);
      if (added.ok()) granted += *added;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(granted.load(), 9);  // three sequences of 3 pages fit in 10; a fourth does not
  EXPECT_EQ(table.TenantPages("a"), 9);
  EXPECT_EQ(alloc.num_free(), 64 - 9);
}

// Threads create, grow, roll back, look up and release sequences against a pool too small for
// all of them. An owner map checks that no page is ever held by two sequences at once; at the end
// every page is back.
TEST(SequenceTableTest, ConcurrentStress) {
  constexpr int kThreads = 6;
  constexpr int kIterations = 300;
  constexpr int kPages = 16;  // one long sequence can exhaust it alone; several surely do
  PageAllocator alloc(kPages);
  SequenceTable table(Options(), &alloc);
  std::vector<std::atomic<int>> owner(kPages);
  for (auto& o : owner) o = -1;
  std::atomic<int> exhausted{0};
  std::atomic<int> failures{0};

  // Claims pages [from, end) of seq for thread t; any page already claimed is a double hand-out.
  auto claim = [&](const std::vector<int32_t>& pages, size_t from, int t) {
    for (size_t i = from; i < pages.size(); ++i) {
      int expected = -1;
      if (!owner[pages[i]].compare_exchange_strong(expected, t)) ++failures;
    }
  };
  auto unclaim = [&](const std::vector<int32_t>& pages, size_t from, int t) {
    for (size_t i = from; i < pages.size(); ++i) {
      int expected = t;
      if (!owner[pages[i]].compare_exchange_strong(expected, -1)) ++failures;
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      const std::string tenant = absl::StrCat("tenant", t % 2);
      for (int it = 0; it < kIterations; ++it) {
        absl::StatusOr<std::shared_ptr<Sequence>> created = table.Create(tenant);
        if (!created.ok()) {
          ++failures;
          continue;
        }
        std::shared_ptr<Sequence> seq = *created;
        int64_t length = 0;
        const int steps = 1 + rng() % 5;
        for (int s = 0; s < steps; ++s) {
          absl::StatusOr<std::shared_ptr<Sequence>> found = table.Find(seq->id, tenant);
          if (!found.ok() || found->get() != seq.get()) ++failures;
          MutexLock lock(&seq->mu);
          const size_t had = seq->pages.size();
          const int64_t target = length + 1 + rng() % (4 * kPageSize);
          absl::StatusOr<int64_t> added = table.EnsureCapacity(seq.get(), target);
          if (!added.ok()) {
            if (added.status().code() != absl::StatusCode::kResourceExhausted) ++failures;
            if (seq->pages.size() != had) ++failures;  // all or nothing
            ++exhausted;
            continue;
          }
          if (seq->pages.size() != had + *added) ++failures;
          claim(seq->pages, had, t);
          if (rng() % 3 == 0) {  // the request failed: undo
            unclaim(seq->pages, had, t);
            table.Rollback(seq.get(), *added);
            if (seq->pages.size() != had) ++failures;
          } else {
            length = target;
          }
        }
        {
          MutexLock lock(&seq->mu);
          unclaim(seq->pages, 0, t);
        }
        absl::StatusOr<int64_t> freed = table.Release(seq->id, tenant);
        if (!freed.ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, 0);
  EXPECT_GT(exhausted, 0) << "the pool was never contended; the test is too gentle";
  EXPECT_EQ(table.size(), 0);
  EXPECT_EQ(alloc.num_free(), alloc.num_total());
  for (int p = 0; p < kPages; ++p) EXPECT_EQ(owner[p], -1) << "page " << p;
}

}  // namespace
}  // namespace attnd
