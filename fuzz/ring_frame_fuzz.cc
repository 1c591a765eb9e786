// libFuzzer target: version 2 ring frames (proto/attnd/v1/ring_frame.h). The input is one request
// frame, as attnd copies it out of a ring's request half. The parser must refuse it with
// INVALID_ARGUMENT and a message, or accept it with every view inside the input, its counts within
// their caps; an accepted frame then runs through the service's frame handler against the real
// AttentionService (fuzz/harness.h), which must answer a documented code with a message, give an
// OK answer whose lengths and inline output match what it claims, and leave the pages adding up.
// As in request_fuzz, ids and region ids of 0 or 1 bytes name this input's sequences and the
// harness's region.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/harness.h"

namespace {

bool Inside(absl::string_view view, absl::string_view frame) {
  return view.empty() ||
         (view.data() >= frame.data() && view.data() + view.size() <= frame.data() + frame.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using attnd::fuzz::Harness;
  namespace v2 = attnd::ring::v2;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  attnd::RequestFrame frame;
  const absl::Status parsed = attnd::ParseRequestFrame(bytes, &frame);
  if (!parsed.ok()) {
    ATTND_FUZZ_CHECK(
        parsed.code() == absl::StatusCode::kInvalidArgument && !parsed.message().empty(),
        "refused with %s", parsed.ToString().c_str());
    return 0;
  }
  ATTND_FUZZ_CHECK(frame.bytes == size, "frame.bytes %llu of %zu",
                   static_cast<unsigned long long>(frame.bytes), size);
  ATTND_FUZZ_CHECK(!frame.sequence_ids.empty() && frame.sequence_ids.size() <= v2::kMaxSequences,
                   "%zu sequence ids", frame.sequence_ids.size());
  ATTND_FUZZ_CHECK(frame.op != v2::kPrefill || frame.sequence_ids.size() == 1, "prefill of many");
  for (absl::string_view id : frame.sequence_ids) {
    ATTND_FUZZ_CHECK(Inside(id, bytes), "a sequence id outside the frame");
  }
  for (const attnd::FrameTensor* t : {&frame.q, &frame.k, &frame.v, &frame.o}) {
    ATTND_FUZZ_CHECK(Inside(t->data, bytes) && Inside(t->region_id, bytes),
                     "a tensor's bytes outside the frame");
    ATTND_FUZZ_CHECK(t->rank >= 0 && t->rank <= v2::kMaxRank, "rank %d", t->rank);
  }
  ATTND_FUZZ_CHECK(frame.q.where != v2::kAbsent && frame.o.where != v2::kInline, "q absent");

  Harness& h = Harness::Get();
  const std::vector<std::string> ids = h.NewSequences(2);
  h.Warm(ids[1], 5);
  for (absl::string_view& id : frame.sequence_ids) {
    if (id.size() <= 1) id = ids[id.empty() ? 0 : static_cast<unsigned char>(id[0]) % ids.size()];
  }
  for (attnd::FrameTensor* t : {&frame.q, &frame.k, &frame.v, &frame.o}) {
    if (t->where == v2::kRegion && t->region_id.size() <= 1) t->region_id = h.region_id();
  }
  attnd::FrameAnswer answer;
  const absl::Status s = h.RunFrame(frame, &answer);
  Harness::CheckStatus("ring frame", static_cast<int>(s.code()), std::string(s.message()));
  if (s.ok()) {
    ATTND_FUZZ_CHECK(answer.lengths.size() == frame.sequence_ids.size(), "%zu lengths for %zu ids",
                     answer.lengths.size(), frame.sequence_ids.size());
    ATTND_FUZZ_CHECK(answer.output_in_region == (frame.o.where == v2::kRegion),
                     "output in the region: %d", answer.output_in_region);
    ATTND_FUZZ_CHECK(answer.shape.size() == 3, "o of rank %zu", answer.shape.size());
    if (!answer.output_in_region) {
      const uint64_t want =
          static_cast<uint64_t>(answer.shape[0] * answer.shape[1] * answer.shape[2]) *
          attnd::ElementSize(static_cast<attnd::DType>(answer.dtype));
      ATTND_FUZZ_CHECK(answer.output != nullptr && answer.output_bytes == want,
                       "inline o of %llu bytes, its shape needs %llu",
                       static_cast<unsigned long long>(answer.output_bytes),
                       static_cast<unsigned long long>(want));
    }
  }
  h.CheckBudgetReturned();
  h.ReleaseAll(ids);
  return 0;
}
