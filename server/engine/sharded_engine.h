// One engine over several shards, each holding a slice of the kv heads and the q heads of their
// groups (a q head reads only its group's kv head, so attention needs no communication between
// shards). Every shard holds every page of the pool for its heads: one page table per sequence
// serves all shards, and the runtime's page bookkeeping is unchanged.
//
// A job is split by head group without copying: each shard gets views of its heads of the
// request's tensors (TensorView::row_pitch) and writes its heads of the output in place
// (PrefillJob::out_row_pitch). The shards run concurrently, the caller running the first; a job
// fails when any shard fails, naming it. A failed job may have written K/V past the committed
// lengths in the other shards, which the Engine contract allows: the runtime rolls the pages back
// once for all shards.
#ifndef ATTND_SERVER_ENGINE_SHARDED_ENGINE_H_
#define ATTND_SERVER_ENGINE_SHARDED_ENGINE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/dca.h"
#include "server/config/sparse_config.h"
#include "server/engine/engine.h"

namespace attnd {

// The geometry of each of `num_shards` shards: num_kv_heads / num_shards kv heads and their q
// heads. INVALID_ARGUMENT when the kv heads do not split evenly.
absl::StatusOr<DcaGeometry> ShardGeometry(const DcaGeometry& geometry, int32_t num_shards);

// The sparse budgets of q heads [first_q_head, first_q_head + num_q_heads) of every layer.
std::shared_ptr<const SparseAttentionConfig> ShardSparse(const SparseAttentionConfig& sparse,
                                                         int32_t first_q_head, int32_t num_q_heads);

// Wraps shards built for ShardGeometry(geometry, shards.size()) in head order, their layouts
// alike but for the kv heads (same layers, pages, page size, head_dim and dtype); one shard is
// returned as it is. INVALID_ARGUMENT when they do not fit together.
absl::StatusOr<std::unique_ptr<Engine>> CreateShardedEngine(
    const DcaGeometry& geometry, std::vector<std::unique_ptr<Engine>> shards);

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_SHARDED_ENGINE_H_
