// What the server tests share: the tiny model (configs/tiny/config.json's geometry, small enough
// for exact CPU references) and random inputs.
#ifndef ATTND_SERVER_CONFIG_TEST_MODELS_H_
#define ATTND_SERVER_CONFIG_TEST_MODELS_H_

#include <cstdint>
#include <random>
#include <vector>

#include "server/config/model_config.h"

namespace attnd::test_models {

// 2 layers, 4 q heads, 2 kv heads, head_dim 64, DCA chunk_size 160 / local_size 32 (chunk_len 128),
// original_max_position_embeddings 256, softmax scale 1/8; rope_theta 1e4 over all 64 dims.
inline ModelConfig TinyModel() {
  ModelConfig m;
  m.name = "tiny";
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.max_position_embeddings = 4096;
  m.chunk_size = 160;
  m.local_size = 32;
  m.original_max_position_embeddings = 256;
  m.softmax_scale = 0.125f;
  m.rope_theta = 10000.0;  // configs/tiny: rope_theta 1e4, no partial_rotary_factor
  m.rotary_dim = 64;
  return m;
}

// n draws from N(0, 1).
inline std::vector<float> RandomFloats(int64_t n, std::mt19937* rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return v;
}

}  // namespace attnd::test_models

#endif  // ATTND_SERVER_CONFIG_TEST_MODELS_H_
