// Writes the seed corpus of the fuzz targets (committed under fuzz/corpus/<target>/): valid and
// nearly valid requests for fuzz/harness.h's tiny model (Hq 2, Hkv 1, D 8, 2 layers), config files.
// Usage: make_corpus OUT_DIR   (script/fuzz --make-corpus runs it)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "attnd/v1/attention.pb.h"
#include "attnd/v1/ring_frame.h"

namespace v1 = attnd::v1;

namespace {

std::string out_dir;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  std::ofstream f(out_dir + "/" + target + "/" + name, std::ios::binary);
  f << bytes;
}

v1::Tensor T(v1::DType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  int64_t n = 1;
  for (int64_t s : shape) {
    t.add_shape(s);
    n *= s;
  }
  const int bytes = dtype == v1::DTYPE_FP32 ? 4 : 2;
  std::string data(n * bytes, '\0');
  for (int64_t i = 0; i < n; ++i) data[i * bytes + bytes - 1] = (i % 3 == 0) ? 0x3f : 0xbe;
  t.set_data(data);
  return t;
}

v1::PrefillRequest Prefill(v1::DType dtype, int64_t tokens, int32_t layer, const char* id) {
  v1::PrefillRequest r;
  r.set_sequence_id(id);
  r.set_layer(layer);
  *r.mutable_q() = T(dtype, {tokens, 5, 2, 8});
  *r.mutable_k() = T(dtype, {tokens, 1, 8});
  *r.mutable_v() = T(dtype, {tokens, 1, 8});
  return r;
}

v1::DecodeRequest Decode(v1::DType dtype, int variants, std::vector<const char*> ids) {
  v1::DecodeRequest r;
  r.set_layer(0);
  for (const char* id : ids) {
    v1::DecodeEntry* e = r.add_entries();
    e->set_sequence_id(id);
    *e->mutable_q() = T(dtype, {variants, 2, 8});
    *e->mutable_k() = T(dtype, {1, 8});
    *e->mutable_v() = T(dtype, {1, 8});
  }
  return r;
}

std::string Tagged(char which, const google::protobuf::Message& m) {
  return std::string(1, which) + m.SerializeAsString();
}

std::string Framed(const std::vector<v1::SessionRequest>& requests) {
  std::string out;
  for (const v1::SessionRequest& r : requests) {
    const std::string b = r.SerializeAsString();
    out.push_back(static_cast<char>(b.size() & 0xff));
    out.push_back(static_cast<char>(b.size() >> 8));
    out += b;
  }
  return out;
}

// A version 2 ring frame for the tiny model: the header, the ids' table and ids, a region id (""
// names the harness's region), then each inline tensor (values as T makes them).
namespace v2 = attnd::ring::v2;
struct FrameTensor {
  uint16_t where = v2::kInline;
  v1::DType dtype = v1::DTYPE_FP32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // in the region
};
std::string Frame(v2::Op op, std::vector<std::string> ids, std::vector<FrameTensor> tensors,
                  int64_t prompt_len = -1, uint16_t q_layout = 0) {
  v2::RequestHeader h{};
  h.magic = v2::kRequestMagic;
  h.op = op;
  h.q_layout = q_layout;
  h.tag = 7;
  h.num_sequences = static_cast<uint32_t>(ids.size());
  if (prompt_len >= 0) {
    h.flags = v2::kHasPromptLen;
    h.prompt_len = prompt_len;
  }
  std::string f(sizeof(h), '\0');
  h.ids_offset = f.size();
  uint32_t at = static_cast<uint32_t>(f.size() + ids.size() * sizeof(v2::StrRef));
  for (const std::string& id : ids) {
    const v2::StrRef ref{at, static_cast<uint32_t>(id.size())};
    f.append(reinterpret_cast<const char*>(&ref), sizeof(ref));
    at += static_cast<uint32_t>(id.size());
  }
  for (const std::string& id : ids) f += id;
  v2::Tensor* slots[] = {&h.q, &h.k, &h.v, &h.o};
  for (size_t i = 0; i < tensors.size(); ++i) {
    v2::Tensor& t = *slots[i];
    const FrameTensor& in = tensors[i];
    t.where = in.where;
    t.dtype = in.dtype;
    t.rank = static_cast<uint16_t>(in.shape.size());
    for (size_t d = 0; d < in.shape.size(); ++d) t.shape[d] = in.shape[d];
    const std::string data = T(in.dtype, in.shape).data();
    if (in.where == v2::kRegion) {
      t.region_id = {static_cast<uint32_t>(f.size()), 0};
      t.offset = in.offset;
      t.bytes = data.size();
    } else if (in.where == v2::kInline) {
      f.resize(v2::AlignUp(f.size(), v2::kTensorAlign), '\0');
      t.offset = f.size();
      t.bytes = data.size();
      f += data;
    }
  }
  std::memcpy(f.data(), &h, sizeof(h));
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  out_dir = argv[1];
  // request_fuzz: byte 0 = 0 Prefill, 1 Decode, 2 ReleaseSequence, 3 Session.
  Write("request_fuzz", "prefill_fp32", Tagged(0, Prefill(v1::DTYPE_FP32, 3, 0, "")));
  Write("request_fuzz", "prefill_bf16_layer1", Tagged(0, Prefill(v1::DTYPE_BF16, 2, 1, "")));
  v1::PrefillRequest with_len = Prefill(v1::DTYPE_FP16, 4, 0, "\x01");
  with_len.set_prompt_len(40);
  Write("request_fuzz", "prefill_fp16_prompt_len", Tagged(0, with_len));
  Write("request_fuzz", "prefill_unknown_id",
        Tagged(0, Prefill(v1::DTYPE_FP32, 1, 0, "0123456789abcdef0123456789abcdef")));
  // wire_fuzz: byte 0 = how the rest is sliced (0: one slice, 1..8: every n bytes), a
  // PrefillRequest.
  Write("wire_fuzz", "prefill_one_slice", Tagged(0, Prefill(v1::DTYPE_FP32, 3, 0, "")));
  Write("wire_fuzz", "prefill_bf16_sliced_3", Tagged(3, Prefill(v1::DTYPE_BF16, 2, 1, "")));
  Write("wire_fuzz", "prefill_prompt_len_sliced_1", Tagged(1, with_len));
  Write("request_fuzz", "decode_fp32_seq1", Tagged(1, Decode(v1::DTYPE_FP32, 3, {"\x01"})));
  Write("request_fuzz", "decode_bf16_5var", Tagged(1, Decode(v1::DTYPE_BF16, 5, {"\x01"})));
  Write("request_fuzz", "decode_two_entries",
        Tagged(1, Decode(v1::DTYPE_FP32, 3, {"\x00", "\x01"})));
  v1::ReleaseSequenceRequest release;
  release.set_sequence_id("\x01");
  Write("request_fuzz", "release", Tagged(2, release));
  // Tensors in the harness's shm region (a region id of 0 or 1 bytes names it), output there too.
  auto in_region = [](v1::Tensor* t, uint64_t offset) {
    const uint64_t bytes = t->data().size();
    t->clear_data();
    t->mutable_region()->set_offset(offset);
    t->mutable_region()->set_byte_size(bytes);
  };
  v1::PrefillRequest regions = Prefill(v1::DTYPE_FP32, 3, 0, "");
  in_region(regions.mutable_q(), 0);
  in_region(regions.mutable_k(), 4096);
  in_region(regions.mutable_v(), 8192);
  regions.mutable_output_region()->set_offset(16384);
  regions.mutable_output_region()->set_byte_size(3 * 2 * 8 * 4);
  Write("request_fuzz", "prefill_regions", Tagged(0, regions));
  v1::DecodeRequest decode_regions = Decode(v1::DTYPE_BF16, 3, {"\x01"});
  in_region(decode_regions.mutable_entries(0)->mutable_q(), 0);
  decode_regions.mutable_entries(0)->mutable_output_region()->set_offset(1024);
  decode_regions.mutable_entries(0)->mutable_output_region()->set_byte_size(2 * 8 * 2);
  Write("request_fuzz", "decode_regions", Tagged(1, decode_regions));
  v1::SessionRequest s1;
  s1.set_tag(9);
  *s1.mutable_prefill() = Prefill(v1::DTYPE_FP32, 2, 1, "\x01");
  Write("request_fuzz", "session_prefill", Tagged(3, s1));

  // session_fuzz: length-prefixed SessionRequests.
  std::vector<v1::SessionRequest> chain;
  for (int layer = 0; layer < 2; ++layer) {
    v1::SessionRequest r;
    r.set_tag(1 + layer);
    *r.mutable_prefill() = Prefill(v1::DTYPE_FP32, 3, layer, "");
    chain.push_back(r);
  }
  v1::SessionRequest d;
  d.set_tag(3);
  *d.mutable_decode() = Decode(v1::DTYPE_FP32, 3, {"", "\x01"});
  chain.push_back(d);
  Write("session_fuzz", "prefill_prefill_decode", Framed(chain));
  v1::SessionRequest empty;
  empty.set_tag(4);
  Write("session_fuzz", "empty_then_decode", Framed({empty, d}));
  v1::SessionRequest bf;
  bf.set_tag(5);
  *bf.mutable_decode() = Decode(v1::DTYPE_BF16, 5, {"\x01", "\x01"});  // the same sequence twice
  Write("session_fuzz", "duplicate_entries", Framed({bf}));

  // ring_frame_fuzz: one version 2 request frame ("\x01" names the warmed sequence).
  Write("ring_frame_fuzz", "prefill_fp32",
        Frame(v2::kPrefill, {""},
              {{v2::kInline, v1::DTYPE_FP32, {3, 5, 2, 8}},
               {v2::kInline, v1::DTYPE_FP32, {3, 1, 8}},
               {v2::kInline, v1::DTYPE_FP32, {3, 1, 8}}}));
  Write("ring_frame_fuzz", "prefill_bf16_prompt_len_pre_rotary",
        Frame(v2::kPrefill, {""},
              {{v2::kInline, v1::DTYPE_BF16, {4, 2, 8}},
               {v2::kInline, v1::DTYPE_BF16, {4, 1, 8}},
               {v2::kInline, v1::DTYPE_BF16, {4, 1, 8}}},
              /*prompt_len=*/40, /*q_layout=*/1));
  Write("ring_frame_fuzz", "prefill_regions",
        Frame(v2::kPrefill, {""},
              {{v2::kRegion, v1::DTYPE_FP32, {3, 5, 2, 8}, 0},
               {v2::kRegion, v1::DTYPE_FP32, {3, 1, 8}, 4096},
               {v2::kInline, v1::DTYPE_FP32, {3, 1, 8}},
               {v2::kRegion, v1::DTYPE_FP32, {3, 2, 8}, 16384}}));
  Write("ring_frame_fuzz", "decode_two",
        Frame(v2::kDecode, {"\x01", ""},
              {{v2::kInline, v1::DTYPE_FP32, {2, 3, 2, 8}},
               {v2::kInline, v1::DTYPE_FP32, {2, 1, 8}},
               {v2::kInline, v1::DTYPE_FP32, {2, 1, 8}}}));
  Write("ring_frame_fuzz", "decode_regions_bf16",
        Frame(v2::kDecode, {"\x01"},
              {{v2::kRegion, v1::DTYPE_BF16, {1, 5, 2, 8}, 0},
               {v2::kRegion, v1::DTYPE_BF16, {1, 1, 8}, 1024},
               {v2::kRegion, v1::DTYPE_BF16, {1, 1, 8}, 2048},
               {v2::kRegion, v1::DTYPE_BF16, {1, 2, 8}, 4096}}));

  // config_fuzz: byte 0 even = config.json, odd = sparse pattern; byte 1 = layers/heads.
  Write("config_fuzz", "tiny", std::string("\0\0", 2) + R"({"num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
 "max_position_embeddings": 4096, "dual_chunk_attention_config": {"chunk_size": 160,
 "local_size": 32, "original_max_position_embeddings": 256}, "sparse_attention_enabled": true,
 "sparse_attention_threshold": 100, "sparse_attention_last_q": 8})");
  Write("config_fuzz", "qwen_like", std::string("\0\0", 2) + R"({"_name_or_path": "q",
 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
 "hidden_size": 3584, "max_position_embeddings": 1010000, "dual_chunk_attention_config":
 {"chunk_size": 262144, "local_size": 8192, "original_max_position_embeddings": 32768}})");
  Write(
      "config_fuzz", "sparse_1x2",
      std::string("\x01\x03", 2) +
          R"([{"0": ["vertical_and_slash", 1000, 6096, 0.5], "1": ["vertical_and_slash", 30, 800, 1]}])");
  Write(
      "config_fuzz", "sparse_2x1",
      std::string("\x01\x01", 2) +
          R"([{"0": ["vertical_and_slash", 1, 1, 0]}, {"0": ["vertical_and_slash", 3500, 100, 3.5]}])");
  return 0;
}
