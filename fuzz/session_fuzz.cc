// libFuzzer target: the Session stream handler. The input is up to 8 SessionRequests, each
// prefixed by its length (2 bytes, little-endian); they go over one stream in order, each answer
// read before the next request (as the protocol says), against the real AttentionService
// (fuzz/harness.h). Each answer must carry its request's tag and a documented code with a message;
// the stream must end OK; pages must add up before and after releasing the input's sequences.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using attnd::fuzz::Harness;
  namespace v1 = attnd::v1;
  std::vector<v1::SessionRequest> requests;
  size_t at = 0;
  while (at + 2 <= size && requests.size() < 8) {
    const size_t n = data[at] | (static_cast<size_t>(data[at + 1]) << 8);
    at += 2;
    if (n > size - at) break;
    v1::SessionRequest r;
    if (r.ParseFromArray(data + at, static_cast<int>(n))) requests.push_back(std::move(r));
    at += n;
  }
  if (requests.empty()) return 0;

  Harness& h = Harness::Get();
  const std::vector<std::string> ids = h.NewSequences(2);
  h.Warm(ids[1], 5);
  grpc::ClientContext context;
  auto stream = h.stub().Session(&context);
  for (v1::SessionRequest& r : requests) {
    if (r.has_prefill()) Harness::MapId(ids, r.mutable_prefill()->mutable_sequence_id());
    if (r.has_decode()) {
      for (v1::DecodeEntry& e : *r.mutable_decode()->mutable_entries()) {
        Harness::MapId(ids, e.mutable_sequence_id());
      }
    }
    ATTND_FUZZ_CHECK(stream->Write(r), "Session: write failed");
    v1::SessionResponse response;
    ATTND_FUZZ_CHECK(stream->Read(&response), "Session: stream ended early");
    ATTND_FUZZ_CHECK(response.tag() == r.tag(), "Session: tag %llu answered %llu",
                     static_cast<unsigned long long>(r.tag()),
                     static_cast<unsigned long long>(response.tag()));
    Harness::CheckStatus("Session", response.code(), response.message());
    if (response.code() == 0) {
      ATTND_FUZZ_CHECK(
          response.has_prefill() == r.has_prefill() && response.has_decode() == r.has_decode(),
          "Session: OK answer of the wrong kind");
    }
    h.CheckPages(ids);
  }
  stream->WritesDone();
  grpc::Status status = stream->Finish();
  ATTND_FUZZ_CHECK(status.ok(), "Session ended %d: %s", status.error_code(),
                   status.error_message().c_str());
  h.ReleaseAll(ids);
  return 0;
}
