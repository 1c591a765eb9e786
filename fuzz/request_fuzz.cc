// libFuzzer target: one request's bytes, as the service would receive them, through the real
// AttentionService and Runtime (fuzz/harness.h). Input: byte 0 picks the RPC (Prefill, Decode,
// ReleaseSequence, a one-request Session, or a ring's request through the ring's handler), the
// rest is that request's serialized proto; bytes that do not parse are skipped (gRPC would refuse
// them before attnd sees them). Region references may name up to 48 GiB of a sparse object: every
// call must end with a documented code and give back every request byte it took.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/harness.h"

namespace {

using attnd::fuzz::Harness;
namespace v1 = attnd::v1;

int64_t Elements(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t s : t.shape()) n *= s;
  return n;
}

int ElementBytes(v1::DType d) { return d == v1::DTYPE_FP32 ? 4 : 2; }

// An OK output tensor must be exactly what its shape and dtype say.
void CheckOutput(const char* rpc, const v1::Tensor& o) {
  ATTND_FUZZ_CHECK(o.shape_size() >= 2, "%s: output of rank %d", rpc, o.shape_size());
  ATTND_FUZZ_CHECK(static_cast<int64_t>(o.data().size()) == Elements(o) * ElementBytes(o.dtype()),
                   "%s: output holds %zu bytes", rpc, o.data().size());
}

void MapDecode(const Harness& h, const std::vector<std::string>& ids, v1::DecodeRequest* r) {
  for (v1::DecodeEntry& e : *r->mutable_entries()) {
    Harness::MapId(ids, e.mutable_sequence_id());
    h.MapTensor(e.mutable_q());
    h.MapTensor(e.mutable_k());
    h.MapTensor(e.mutable_v());
    if (e.has_output_region()) h.MapRegion(e.mutable_output_region());
  }
}

void MapPrefill(const Harness& h, const std::vector<std::string>& ids, v1::PrefillRequest* r) {
  Harness::MapId(ids, r->mutable_sequence_id());
  h.MapTensor(r->mutable_q());
  h.MapTensor(r->mutable_k());
  h.MapTensor(r->mutable_v());
  if (r->has_output_region()) h.MapRegion(r->mutable_output_region());
}

// An output that went to a region carries its reference and no bytes; else as CheckOutput.
void CheckAnyOutput(const char* rpc, const v1::Tensor& o) {
  if (o.has_region()) {
    ATTND_FUZZ_CHECK(o.data().empty(), "%s: output in a region also carries bytes", rpc);
    return;
  }
  CheckOutput(rpc, o);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Harness& h = Harness::Get();
  const int which = data[0] % 5;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  v1::PrefillRequest prefill;
  v1::DecodeRequest decode;
  v1::ReleaseSequenceRequest release;
  v1::SessionRequest session;
  const bool parsed = which == 0   ? prefill.ParseFromString(bytes)
                      : which == 1 ? decode.ParseFromString(bytes)
                      : which == 2 ? release.ParseFromString(bytes)
                                   : session.ParseFromString(bytes);  // 3: Session, 4: ring
  if (!parsed) return 0;

  const std::vector<std::string> ids = h.NewSequences(2);
  h.Warm(ids[1], 5);  // the second sequence has tokens, so decodes can reach the engine
  grpc::ClientContext context;
  grpc::Status status;
  switch (which) {
    case 0: {
      MapPrefill(h, ids, &prefill);
      v1::PrefillResponse response;
      status = h.stub().Prefill(&context, prefill, &response);
      if (status.ok()) CheckAnyOutput("Prefill", response.o());
      break;
    }
    case 1: {
      MapDecode(h, ids, &decode);
      v1::DecodeResponse response;
      status = h.stub().Decode(&context, decode, &response);
      if (status.ok()) {
        ATTND_FUZZ_CHECK(response.outputs_size() == decode.entries_size(), "Decode: %d outputs",
                         response.outputs_size());
        for (const v1::DecodeOutput& o : response.outputs()) CheckAnyOutput("Decode", o.o());
      }
      break;
    }
    case 2: {
      Harness::MapId(ids, release.mutable_sequence_id());
      v1::ReleaseSequenceResponse response;
      status = h.stub().ReleaseSequence(&context, release, &response);
      break;
    }
    case 4: {
      if (session.has_prefill()) MapPrefill(h, ids, session.mutable_prefill());
      if (session.has_decode()) MapDecode(h, ids, session.mutable_decode());
      v1::SessionResponse response;
      const absl::Status s = h.RunAsRing(session, &response);
      Harness::CheckStatus("Ring", static_cast<int>(s.code()), std::string(s.message()));
      if (s.ok() && response.has_prefill()) CheckAnyOutput("Ring", response.prefill().o());
      break;
    }
    default: {
      if (session.has_prefill()) MapPrefill(h, ids, session.mutable_prefill());
      if (session.has_decode()) MapDecode(h, ids, session.mutable_decode());
      auto stream = h.stub().Session(&context);
      ATTND_FUZZ_CHECK(stream->Write(session), "Session: write failed");
      v1::SessionResponse response;
      ATTND_FUZZ_CHECK(stream->Read(&response), "Session: no response");
      ATTND_FUZZ_CHECK(response.tag() == session.tag(), "Session: tag %llu for %llu",
                       static_cast<unsigned long long>(response.tag()),
                       static_cast<unsigned long long>(session.tag()));
      if (response.code() == 0 && response.has_prefill()) {
        CheckAnyOutput("Session", response.prefill().o());
      }
      Harness::CheckStatus("Session.request", response.code(), response.message());
      stream->WritesDone();
      status = stream->Finish();
      break;
    }
  }
  Harness::CheckStatus("rpc", status.error_code(), status.error_message());
  h.CheckBudgetReturned();
  // A released sequence (case 2) is gone; the rest are released and the pool must be whole.
  std::vector<std::string> live;
  for (const std::string& id : ids) {
    if (h.runtime().LayerLengths(id, "").ok()) live.push_back(id);
  }
  h.ReleaseAll(live);
  return 0;
}
