#include "server/engine/cuda_engine.h"

#include <cuda.h>  // driver types only: driver functions come through the runtime's entry point
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "base/thread_pool.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/decode_step.h"
#include "kernels/cuda/rotary_cuda.h"
#include "kernels/cuda/sparse_cuda.h"
#include "kernels/dual_chunk_rotary.h"
#include "kernels/vertical_slash.h"
#include "server/dataplane/regions.h"
#include "spdlog/spdlog.h"

namespace attnd {
namespace {

constexpr size_t kAlign = 256;
// Decode batches of at least this many rows copy their rows into and out of pinned memory on
// kCopyThreads threads: from there on the copies, not the kernels, are most of a step (measured
// in docs/batching.md), and a hand-off to the pool costs less than the copies it splits.
constexpr int32_t kParallelCopyRows = 16;
constexpr int kCopyThreads = 4;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct HostFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using DevicePtr = std::unique_ptr<void, DeviceFree>;
using PinnedPtr = std::unique_ptr<void, HostFree>;

absl::StatusOr<DevicePtr> DeviceAlloc(size_t bytes, absl::string_view what) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, kAlign));
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) allocation error
    return absl::ResourceExhaustedError(absl::StrCat("cuda engine: cannot allocate ", bytes,
                                                     " device bytes for ", what, ": ",
                                                     cudaGetErrorString(err)));
  }
  return DevicePtr(p);
}

absl::StatusOr<PinnedPtr> PinnedAlloc(size_t bytes, absl::string_view what) {
  void* p = nullptr;
  const cudaError_t err = cudaMallocHost(&p, std::max<size_t>(bytes, kAlign));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cuda engine: cannot allocate ", bytes,
                                                     " pinned host bytes for ", what, ": ",
                                                     cudaGetErrorString(err)));
  }
  return PinnedPtr(p);
}

char* At(const DevicePtr& p, size_t off) { return static_cast<char*>(p.get()) + off; }
char* At(const PinnedPtr& p, size_t off) { return static_cast<char*>(p.get()) + off; }

std::string FormatUuid(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  std::string hex;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) hex += '-';
    absl::StrAppend(&hex, absl::Hex(b[i], absl::kZeroPad2));
  }
  return "GPU-" + hex;
}

// cuMemGetAddressRange through the runtime's driver entry point (attnd links no libcuda): the
// allocation an IPC mapping belongs to, so a region's byte size can be checked against it.
using GetAddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

GetAddressRangeFn AddressRangeFn() {
  static const GetAddressRangeFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return GetAddressRangeFn{nullptr};
    }
    return reinterpret_cast<GetAddressRangeFn>(f);
  }();
  return fn;
}

// A driver function through the runtime's entry point (attnd links no libcuda); null when this
// driver lacks it.
template <typename Fn>
Fn DriverFunction(const char* name, int version) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &f, version, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(f);
}

// A device attribute that the runtime API does not offer, through the driver: false when the driver
// lacks the function or the attribute (an older driver answers an error for an attribute it does
// not know).
bool DriverDeviceAttribute(int device, CUdevice_attribute attribute, int* value) {
  using DeviceGetFn = CUresult (*)(CUdevice*, int);
  using AttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  const auto device_get = DriverFunction<DeviceGetFn>("cuDeviceGet", 2000);
  const auto get = DriverFunction<AttributeFn>("cuDeviceGetAttribute", 12000);
  CUdevice dev = 0;
  return device_get != nullptr && get != nullptr && device_get(&dev, device) == CUDA_SUCCESS &&
         get(value, attribute, dev) == CUDA_SUCCESS;
}

// A green context of all but `reserved` SMs of `device` (rounded to the device's partition
// granularity) and a stream in it at `priority`: work on the stream runs on those SMs only.
struct GreenLane {
  CUgreenCtx context = nullptr;
  cudaStream_t stream = nullptr;
  int32_t sms = 0;    // the lane's
  int32_t total = 0;  // the device's
};

absl::StatusOr<GreenLane> CreateGreenLane(int32_t device, int32_t reserved, int priority) {
  // Each function at the ABI of the headers this is built with (an older version can name an
  // older ABI, or none for functions added since).
  const char* missing = nullptr;
  const auto need = [&missing](auto* fn, const char* name) {
    using Fn = std::remove_pointer_t<decltype(fn)>;
    Fn f = DriverFunction<Fn>(name, CUDA_VERSION);
    if (f == nullptr && missing == nullptr) missing = name;
    return f;
  };
  const auto get_device = need(static_cast<decltype(&cuDeviceGet)*>(nullptr), "cuDeviceGet");
  const auto get_resource =
      need(static_cast<decltype(&cuDeviceGetDevResource)*>(nullptr), "cuDeviceGetDevResource");
  const auto split = need(static_cast<decltype(&cuDevSmResourceSplitByCount)*>(nullptr),
                          "cuDevSmResourceSplitByCount");
  const auto describe = need(static_cast<decltype(&cuDevResourceGenerateDesc)*>(nullptr),
                             "cuDevResourceGenerateDesc");
  const auto create = need(static_cast<decltype(&cuGreenCtxCreate)*>(nullptr), "cuGreenCtxCreate");
  const auto create_stream =
      need(static_cast<decltype(&cuGreenCtxStreamCreate)*>(nullptr), "cuGreenCtxStreamCreate");
  const auto destroy =
      need(static_cast<decltype(&cuGreenCtxDestroy)*>(nullptr), "cuGreenCtxDestroy");
  if (missing != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--decode-reserved-sms needs green contexts: this CUDA driver has no ", missing, " (CUDA ",
        CUDA_VERSION / 1000, ".", CUDA_VERSION % 1000 / 10, " ABI)"));
  }
  const auto failed = [](const char* what, CUresult r) {
    return absl::InternalError(absl::StrCat("--decode-reserved-sms: ", what, " failed (CUresult ",
                                            static_cast<int>(r), ")"));
  };
  CUdevice dev;
  if (CUresult r = get_device(&dev, device); r != CUDA_SUCCESS) return failed("cuDeviceGet", r);
  CUdevResource all{};
  if (CUresult r = get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM); r != CUDA_SUCCESS) {
    return failed("cuDeviceGetDevResource", r);
  }
  GreenLane lane;
  lane.total = static_cast<int32_t>(all.sm.smCount);
  const int64_t want = int64_t{lane.total} - reserved;
  if (want < static_cast<int64_t>(all.sm.minSmPartitionSize)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--decode-reserved-sms ", reserved, " leaves the prefill lane ", want, " of the device's ",
        lane.total, " SMs; it needs at least ", all.sm.minSmPartitionSize));
  }
  // A group of at least `want` SMs, rounded up by the driver; what it leaves is decode's alone.
  // Rounding up could leave nothing, so ask for less until something is left.
  CUdevResource part{}, rest{};
  unsigned int groups = 1;
  for (int64_t ask = want;; ask -= std::max(1u, all.sm.smCoscheduledAlignment)) {
    if (ask < static_cast<int64_t>(all.sm.minSmPartitionSize)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--decode-reserved-sms ", reserved, ": no partition of the device's ", lane.total,
          " SMs leaves that many free (granularity ", all.sm.smCoscheduledAlignment, ")"));
    }
    groups = 1;
    if (CUresult r = split(&part, &groups, &all, &rest, 0, static_cast<unsigned int>(ask));
        r != CUDA_SUCCESS) {
      return failed("cuDevSmResourceSplitByCount", r);
    }
    if (groups == 1 && rest.sm.smCount > 0) break;
  }
  CUdevResourceDesc desc;
  if (CUresult r = describe(&desc, &part, 1); r != CUDA_SUCCESS) {
    return failed("cuDevResourceGenerateDesc", r);
  }
  if (CUresult r = create(&lane.context, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
      r != CUDA_SUCCESS) {
    return failed("cuGreenCtxCreate", r);
  }
  CUstream stream = nullptr;
  if (CUresult r = create_stream(&stream, lane.context, CU_STREAM_NON_BLOCKING, priority);
      r != CUDA_SUCCESS) {
    destroy(lane.context);
    return failed("cuGreenCtxStreamCreate", r);
  }
  lane.stream = reinterpret_cast<cudaStream_t>(stream);
  lane.sms = static_cast<int32_t>(part.sm.smCount);
  return lane;
}

void DestroyGreenContext(CUgreenCtx context) {
  if (context == nullptr) return;
  const auto destroy =
      DriverFunction<decltype(&cuGreenCtxDestroy)>("cuGreenCtxDestroy", CUDA_VERSION);
  if (destroy != nullptr) destroy(context);
}

class CudaEngine : public Engine, public DeviceMemoryOpener {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const CudaEngineOptions& options);
  ~CudaEngine() override;

  std::string backend() const override { return "cuda"; }
  std::string device_name() const override { return device_name_; }
  const KvLayout& layout() const override { return layout_; }
  const DcaGeometry& geometry() const override { return geometry_; }

  absl::Status Prefill(const PrefillJob& job) override;
  absl::StatusOr<std::unique_ptr<PrefillRun>> StartPrefill(const PrefillJob& job) override;
  bool overlaps_prefill_and_decode() const override { return true; }
  absl::StatusOr<DecodeStats> Decode(const DecodeJob& job) override;
  absl::StatusOr<std::unique_ptr<PendingDecode>> StartDecode(const DecodeJob& job) override;
  std::vector<int32_t> decode_batch_sizes() const override { return sizes_; }
  bool decode_graphs() const override { return !graphs_.empty(); }
  std::string device_uuid() const override { return device_uuid_; }
  bool cuda_mps() const override { return cuda_mps_; }
  std::string device() const override { return absl::StrCat("cuda:", device_); }
  absl::StatusOr<std::vector<uint8_t>> CopyPool();
  DeviceMemoryOpener* device_memory_opener() override { return this; }

  // CUDA IPC regions (docs/regions.md): the handle's allocation, opened on this engine's device.
  absl::StatusOr<Mapping> OpenIpcHandle(absl::string_view handle) override;
  void CloseIpcHandle(void* device_ptr) override;
  absl::StatusOr<IpcEvent> CreateIpcEvent() override;
  absl::StatusOr<bool> IpcEventDone(void* event) override;
  void DestroyIpcEvent(void* event) override;
  absl::StatusOr<Gate> CreateGate() override;
  absl::Status ArmGate(const Gate& gate, void* ready_event, uint64_t value) override;
  void DestroyGate(const Gate& gate, bool stuck) override;

 private:
  explicit CudaEngine(const CudaEngineOptions& options)
      : geometry_(options.geometry),
        layout_(options.layout),
        device_(options.device),
        max_decode_batch_(std::max(1, options.max_decode_batch)),
        use_graphs_(options.cuda_graphs),
        prefill_step_keys_(std::max<int64_t>(1, options.prefill_step_keys)),
        decode_reserved_sms_(std::max(0, options.decode_reserved_sms)),
        decode_min_split_keys_(options.decode_min_split_keys),
        sparse_(options.sparse) {
    for (int32_t size : options.graph_batch_sizes) {
      if (size >= 1 && size <= max_decode_batch_ && (sizes_.empty() || size > sizes_.back())) {
        sizes_.push_back(size);
      }
    }
  }

  // Enqueues one decode step on stream_ for `rows` rows of a batch planned as `plan` rows: the
  // stage kernel (inputs and page tables from pinned host memory or a row's device tensors, KV
  // append), the split-K attention and its reduction, which writes the outputs into pinned host
  // memory or a row's device output. Three kernels, no copies; the same calls are captured into
  // the graphs (rows == plan) and launched eagerly.
  absl::Status EnqueueDecodeStep(int32_t layer, int32_t rows, int32_t plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CaptureDecodeGraphs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status Init(int64_t staging_bytes);
  // The sparse kernels' row_block_slice: block lists stored for one attention chunk (at most
  // max_chunk_ rows) at a time, so that one chunk is one converter and one attention launch.
  int32_t SparseRowBlockSlice() const {
    return static_cast<int32_t>(
        std::min<int64_t>((max_chunk_ + kVsBlock - 1) / kVsBlock, kDefaultRowBlockSlice));
  }
  absl::Status CheckPages(int32_t layer, const int32_t* page_table, int64_t num_pages,
                          int64_t length) const;
  // OK for kVariants, and for kPreRotary when the geometry has a rotary.
  absl::Status CheckLayout(QLayout layout) const;
  // The layer's pool as KvT (Bf16, or Int8Kv / Fp8E4m3 with the layer's scale regions).
  template <typename KvT>
  PagedKv<KvT> LayerView(int32_t layer, const int32_t* device_page_table) const;
  // What the bf16 prefill kernels read: the layer's pool (bf16), or for a pool of scaled codes
  // (int8, fp8) the dequant scratch after DequantizePrefix.
  PagedKv<Bf16> PrefillView(int32_t layer, const int32_t* device_page_table) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  // Scaled pool: bf16(code's value * scale) of the layer's positions [0, length) of the prefill's
  // sequence (d_table_) into the scratch, pages 0, 1, ... in order; nothing for bf16.
  absl::Status DequantizePrefix(int32_t layer, int64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  // The pool holds one-byte codes and row scales (int8 or fp8) rather than bf16.
  bool scaled_kv() const { return HasRowScale(layout_.kv_dtype); }
  // f(CodeT{}) with the scaled pool's code type, Int8Kv or Fp8E4m3.
  template <typename F>
  auto WithCodes(F&& f) const {
    return layout_.kv_dtype == DType::kFp8E4m3 ? f(Fp8E4m3{}) : f(Int8Kv{});
  }
  // The engine's checks of a prefill job (what the kernels cannot survive).
  absl::Status CheckPrefillJob(const PrefillJob& job) const;
  class PrefillSteps;
  // Where a stepped prefill is: the staging chunk starting at the call's token `first`, and its
  // next key-tile window (-1: the chunk is not staged yet).
  struct PrefillCursor {
    int64_t first = 0;
    int64_t window = -1;
  };
  // One step of a prefill (StartPrefill): a dense chunk's staging and its first window, a
  // further window, and after the last window the copy-out; a sparse prefill in one step.
  absl::Status PrefillStep(const PrefillJob& job, float s, bool sparse, PrefillCursor* cursor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  // A sparse prefill of the whole call, DCA piece by piece (docs/DCA.md "Vertical-slash sparse
  // prefill"): each piece's K/V appended in staging chunks, its estimate from its last queries,
  // then its rows attended in staging chunks of whole 64-row blocks. Any size of call.
  absl::Status PrefillSparse(const PrefillJob& job, float s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  // The steps of both, on the call's tokens [first, first + count) (count <= max_chunk_):
  // StageQueries leaves their bf16 query variants in d_q_bf16_ rows [0, count); AppendKeys stages
  // their k and v and appends them, length-scaled by s, to the layer's pages; CopyOut copies the
  // staged outputs rows [0, count) to the job's out rows [first, first + count) and waits for the
  // stream. The staging steps write h_prefill_ on the host: the caller makes sure no queued copy
  // still reads the region they overwrite (CopyOut's wait, or its own).
  absl::Status StageQueries(const PrefillJob& job, int64_t first, int64_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  absl::Status AppendKeys(const PrefillJob& job, int64_t first, int64_t count, float s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  absl::Status CopyOut(const PrefillJob& job, int64_t first, int64_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  // Copies the tensor's rows [first_row, first_row + rows) to device_dst (dense rows): host
  // tensors through h_prefill_ at h_off, device tensors (CUDA IPC regions) directly.
  absl::Status StageRows(const TensorView& view, int64_t first_row, int64_t rows, size_t h_off,
                         void* device_dst) ABSL_EXCLUSIVE_LOCKS_REQUIRED(prefill_mu_);
  // Entries [first, first + count) as one launch, counted in *stats: DecodeLaunch packs the rows
  // and queues the step, DecodeFinish waits for it and unpacks the outputs.
  absl::Status DecodeBatch(const DecodeJob& job, size_t first, size_t count, DecodeStats* stats)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DecodeLaunch(const DecodeJob& job, size_t first, size_t count, DecodeStats* stats)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DecodeFinish(const DecodeJob& job, size_t first, size_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine's checks of a decode job (what the kernels cannot survive).
  absl::Status CheckDecodeJob(const DecodeJob& job) const;
  // Whether the step's kernels can read and write device memory `p` in place: memory of this
  // engine's GPU. A region opened on another GPU (a shard past the first, docs/sharding.md) is
  // copied through the row's pinned slots instead. A single visible GPU answers without asking.
  bool OnThisDevice(const void* p) const;
  class Pending;

  const DcaGeometry geometry_;
  const KvLayout layout_;
  const int32_t device_;
  const int32_t max_decode_batch_;
  const bool use_graphs_;
  const int64_t prefill_step_keys_;
  const int32_t decode_reserved_sms_;
  const int32_t decode_min_split_keys_;
  CUgreenCtx prefill_green_ = nullptr;  // the prefill lane's SMs with decode_reserved_sms_ > 0
  const std::shared_ptr<const SparseAttentionConfig> sparse_;
  std::vector<int32_t> sizes_;  // captured sizes, ascending, <= max_decode_batch_
  std::string device_name_;
  std::string device_uuid_;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi
  bool cuda_mps_ = false;    // the context is a CUDA MPS client (set in Init)
  // Kernel choices, occupancy and attributes for this device and geometry (set in Init).
  std::optional<CudaKernelPlan> kernel_plan_;
  DevicePtr pool_;

  // Two lanes, each one job at a time with its own stream and staging: decode (mu_, stream_, at
  // the device's highest stream priority) and prefill (prefill_mu_, prefill_stream_, at the
  // lowest). Their kernels run at once, the device dispatching the decode's blocks first; they
  // touch disjoint pages (the runtime serialises jobs per sequence), so nothing orders them but the
  // host.
  Mutex mu_;
  cudaStream_t stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  Mutex prefill_mu_ ABSL_ACQUIRED_AFTER(mu_);
  cudaStream_t prefill_stream_ ABSL_GUARDED_BY(prefill_mu_) = nullptr;
  // Recorded after a device-ordered decode step that returned without waiting (DeviceOrder).
  // While such a step runs, its kernels still read the pinned row table the next step rewrites
  // and append to pages a released sequence may give back: the next decode waits for it on the
  // host, every prefill on its stream, and closing a CUDA IPC mapping on the host. Created once.
  cudaEvent_t decode_tail_ = nullptr;
  bool decode_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  // Device-ordered rings' gates (DeviceMemoryOpener::Gate): 64-bit words in one pinned block the
  // device can read, made on the first gate; a slot given back keeps its word's value (words only
  // grow, so a step of a closed ring still waiting on it is never held by the next ring's).
  using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  Mutex gates_mu_ ABSL_ACQUIRED_AFTER(mu_);
  uint64_t* gate_words_ ABSL_GUARDED_BY(gates_mu_) = nullptr;
  std::vector<int32_t> free_gates_ ABSL_GUARDED_BY(gates_mu_);
  std::optional<absl::Status> gates_status_ ABSL_GUARDED_BY(gates_mu_);  // set on the first gate
  StreamValueFn wait_value_ = nullptr;   // cuStreamWaitValue64; set once gates_status_ is ok
  StreamValueFn write_value_ = nullptr;  // cuStreamWriteValue64
  // Prefill steps (StartPrefill) wait for the one before last; blocking, so a waiting prefill
  // leaves the host's cores to the decode lane.
  cudaEvent_t prefill_done_[2] ABSL_GUARDED_BY(prefill_mu_) = {nullptr, nullptr};

  // Prefill: one chunk of at most max_chunk_ tokens. Host and device buffers mirror each other:
  // q raw [chunk, 5, Hq, D] (<= fp32), k/v raw [chunk, Hkv, D], out [chunk, Hq, D] (<= fp32).
  // With a sparse config at least 64 tokens, so that a sparse staging chunk holds a whole query
  // block and the estimate's last queries. The sparse path attends a piece of at most max_chunk_
  // rows in one chunk, a longer one in chunks of whole 64-row blocks (the piece's row blocks), at
  // most sparse_rows_ = max_chunk_ rounded down to 64 rows each.
  int64_t max_chunk_ = 0;
  int64_t sparse_rows_ = 0;
  size_t q_off_ = 0, k_off_ = 0, v_off_ = 0, out_off_ = 0, prefill_bytes_ = 0;
  PinnedPtr h_prefill_ ABSL_GUARDED_BY(prefill_mu_);
  DevicePtr d_prefill_ ABSL_GUARDED_BY(prefill_mu_);
  DevicePtr d_q_bf16_ ABSL_GUARDED_BY(prefill_mu_);  // [chunk, 5, Hq, D]
  PinnedPtr h_table_ ABSL_GUARDED_BY(prefill_mu_);   // [num_pages]
  DevicePtr d_table_ ABSL_GUARDED_BY(prefill_mu_);   // [num_pages]
  // Key-tile windows of dense prefill steps: window_tiles_ tiles per launch (0: whole launches,
  // when the kernel takes no windows), their state for one staging chunk.
  int64_t window_tiles_ = 0;
  size_t window_state_bytes_ = 0;
  DevicePtr d_window_state_ ABSL_GUARDED_BY(prefill_mu_);
  size_t sparse_workspace_bytes_ = 0;
  DevicePtr d_sparse_workspace_ ABSL_GUARDED_BY(prefill_mu_);  // when sparse_ is set
  // Scaled pool: K then V, each [step_.max_length, Hkv, D] bf16, dequantised from the pool for the
  // prefill kernels (DequantizePrefix); the identity page table [num_pages] they read it through.
  DevicePtr d_dequant_ ABSL_GUARDED_BY(prefill_mu_);
  DevicePtr d_identity_;
  // Pre-rotary requests (docs/rotary.md): RotaryInvFreq of the geometry on the host (decode rows
  // are rotated there, into their fp32 slots) and on the device (the prefill rotary kernel);
  // empty / null when the geometry has no usable rotary, and pre-rotary jobs are refused.
  std::vector<float> inv_freq_;
  DevicePtr d_inv_freq_ ABSL_GUARDED_BY(prefill_mu_);

  // Decode: the host writes each row's inputs in their own dtype into fixed slots of pinned
  // memory (h_decode_) and its page table into h_tables_ at a fixed stride; the stage kernel reads
  // them through their mapped addresses and fills d_decode_ (lengths, bf16 q) and d_tables_; the
  // last kernel writes host rows' outputs into h_decode_out_. step_ lays them out
  // (kernels/cuda/decode_step.h): every address and stride is fixed, so captured kernels never
  // change.
  CudaDecodeStepLayout step_;
  PinnedPtr h_decode_ ABSL_GUARDED_BY(mu_);
  DevicePtr d_decode_ ABSL_GUARDED_BY(mu_);
  PinnedPtr h_tables_ ABSL_GUARDED_BY(mu_);  // [B, step_.table_stride]
  DevicePtr d_tables_ ABSL_GUARDED_BY(mu_);  // [B, step_.table_stride]
  // [B, Hq, D] fp32-sized slots, written by the device: a host row's output in its own dtype
  // (DecodeStageRow::out points here), fp32 for a row whose output is on another GPU.
  PinnedPtr h_decode_out_ ABSL_GUARDED_BY(mu_);
  // Device rows (CUDA IPC regions): their q/k/v/out addresses go in their DecodeStageRow, and the
  // stage kernel leaves each row's output address here for the reduction (DecodeRowOut [B]).
  DevicePtr d_row_outs_ ABSL_GUARDED_BY(mu_);
  // Scaled pool: the step's new K/V rows, fp32 [B, 2, Hkv, D], between the stage kernel and the
  // quantiser (CudaDecodeStageParams::kv_rows).
  DevicePtr d_kv_rows_ ABSL_GUARDED_BY(mu_);
  int visible_devices_ = 0;  // cudaGetDeviceCount at creation
  // Per row of the launch in flight: 1 when its out is device memory of another GPU, which
  // DecodeFinish converts and copies there (its fp32 output lands in h_decode_out_ as a host
  // row's).
  std::vector<uint8_t> copy_out_ ABSL_GUARDED_BY(mu_);
  DevicePtr d_workspace_ ABSL_GUARDED_BY(mu_);
  std::vector<float> scratch_ ABSL_GUARDED_BY(prefill_mu_);
  ThreadPool copy_pool_{kCopyThreads};  // DecodeBatch's row copies for large batches
  // graphs_[size index * num_layers + layer]; empty when graphs are off.
  std::vector<cudaGraphExec_t> graphs_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<Engine>> CudaEngine::Create(const CudaEngineOptions& options) {
  const DcaGeometry& g = options.geometry;
  const KvLayout& layout = options.layout;
  if (absl::Status s = CheckCudaGeometry(g); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cuda engine: ", s.message()));
  }
  if (layout.num_kv_heads != g.num_kv_heads || layout.head_dim != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda engine: KV layout [", layout.num_kv_heads, " kv heads, head_dim ", layout.head_dim,
        "] does not match the model [", g.num_kv_heads, ", ", g.head_dim, "]"));
  }
  if (layout.kv_dtype != DType::kBf16 && !HasRowScale(layout.kv_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda engine: KV dtype ",
                                                   DTypeName(layout.kv_dtype),
                                                   " is not supported; use bf16, int8 or fp8"));
  }
  if (layout.num_layers <= 0 || layout.page_size <= 0 || layout.num_pages <= 0) {
    return absl::InvalidArgumentError("cuda engine: the KV layout has no layers, pages or slots");
  }
  if (const SparseAttentionConfig* sp = options.sparse.get();
      sp != nullptr && (sp->num_layers != layout.num_layers || sp->num_q_heads != g.num_q_heads ||
                        sp->budgets.size() != static_cast<size_t>(sp->num_layers) *
                                                  static_cast<size_t>(sp->num_q_heads) ||
                        sp->last_q < 1 || sp->last_q > 64 || g.num_q_heads > kMaxSparseHeads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda engine: the sparse attention config (", sp->num_layers, " layers x ", sp->num_q_heads,
        " heads, last_q ", sp->last_q, ") does not match the model (", layout.num_layers,
        " layers x ", g.num_q_heads, " q heads) or the CUDA kernels (at most ", kMaxSparseHeads,
        " q heads, sparse_attention_last_q in [1, 64])"));
  }
  if (layout.num_pages > INT32_MAX || layout.num_pages * int64_t{layout.page_size} > INT32_MAX) {
    return absl::InvalidArgumentError("cuda engine: more than 2^31 token slots in the pool");
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (err != cudaSuccess) cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cuda engine: no usable CUDA device (",
                     err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount() == 0",
                     "); use the cpu backend"));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda engine: device ", options.device, " not in [0, ", count, ")"));
  }
  std::unique_ptr<CudaEngine> engine(new CudaEngine(options));
  ATTND_RETURN_IF_ERROR(engine->Init(options.staging_bytes));
  return std::unique_ptr<Engine>(std::move(engine));
}

absl::Status CudaEngine::Init(int64_t staging_bytes) {
  MutexLock lock(&mu_);
  MutexLock prefill_lock(&prefill_mu_);
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaDeviceProp prop;
  ATTND_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  device_name_ = prop.name;
  device_uuid_ = FormatUuid(prop.uuid);
  {
    int mps = 0;
    cuda_mps_ = DriverDeviceAttribute(device_, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, &mps) && mps != 0;
    spdlog::info("cuda engine: {} ({}), {}", device_name_, device_uuid_,
                 cuda_mps_ ? "a CUDA MPS client: processes under the same MPS daemon share the GPU"
                           : "not under CUDA MPS");
  }
  CudaKernelPlanOptions plan_options;
  plan_options.kv_dtype = layout_.kv_dtype;
  plan_options.decode_min_split_keys = decode_min_split_keys_;
  ATTND_ASSIGN_OR_RETURN(kernel_plan_, CudaKernelPlan::Create(geometry_, device_, plan_options));
  int least = 0, greatest = 0;  // numerically, greatest < least
  ATTND_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
  if (decode_reserved_sms_ > 0) {
    ATTND_ASSIGN_OR_RETURN(const GreenLane lane,
                           CreateGreenLane(device_, decode_reserved_sms_, least));
    prefill_green_ = lane.context;
    prefill_stream_ = lane.stream;
    spdlog::info("cuda engine: prefill runs on {} of the device's {} SMs; {} are decode's alone",
                 lane.sms, lane.total, lane.total - lane.sms);
  } else {
    ATTND_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&prefill_stream_, cudaStreamNonBlocking, least));
  }
  for (cudaEvent_t& event : prefill_done_) {
    ATTND_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync));
  }
  ATTND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&decode_tail_, cudaEventDisableTiming));

  ATTND_ASSIGN_OR_RETURN(pool_, DeviceAlloc(layout_.pool_bytes(), "the KV pool"));
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(pool_.get(), 0, layout_.pool_bytes(), stream_));

  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const int64_t per_token = (kNumQueryVariants * hq * d + 2 * hkv * d + hq * d) * 4;
  if (staging_bytes <= 0) {
    constexpr int64_t kDefaultStagingBytes = int64_t{512} << 20;
    // 16,384 tokens: a chunked prefill's usual 8,192- and 16,384-token calls in one launch each.
    constexpr int64_t kSparseStagingTokens = 16384;
    staging_bytes = sparse_ != nullptr
                        ? std::max(kDefaultStagingBytes, kSparseStagingTokens * per_token)
                        : kDefaultStagingBytes;
  }
  max_chunk_ = std::max<int64_t>(sparse_ != nullptr ? kVsBlock : 1, staging_bytes / per_token);
  sparse_rows_ = max_chunk_ / kVsBlock * kVsBlock;
  q_off_ = 0;
  k_off_ = AlignUp(q_off_ + max_chunk_ * kNumQueryVariants * hq * d * 4);
  v_off_ = AlignUp(k_off_ + max_chunk_ * hkv * d * 4);
  out_off_ = AlignUp(v_off_ + max_chunk_ * hkv * d * 4);
  prefill_bytes_ = AlignUp(out_off_ + max_chunk_ * hq * d * 4);
  ATTND_ASSIGN_OR_RETURN(h_prefill_, PinnedAlloc(prefill_bytes_, "prefill staging"));
  ATTND_ASSIGN_OR_RETURN(d_prefill_, DeviceAlloc(prefill_bytes_, "prefill staging"));
  ATTND_ASSIGN_OR_RETURN(d_q_bf16_,
                         DeviceAlloc(max_chunk_ * kNumQueryVariants * hq * d * 2, "prefill q"));
  if (CheckRotaryGeometry(geometry_).ok()) {
    inv_freq_ = RotaryInvFreq(geometry_.rope_theta, geometry_.rotary_dim);
    ATTND_ASSIGN_OR_RETURN(d_inv_freq_, DeviceAlloc(inv_freq_.size() * 4, "rotary frequencies"));
    ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_inv_freq_.get(), inv_freq_.data(), inv_freq_.size() * 4,
                                          cudaMemcpyHostToDevice));
  }
  if (PrefillTakesWindows(*kernel_plan_)) {
    window_tiles_ = std::max<int64_t>(1, prefill_step_keys_ / PrefillKeyTileKeys(*kernel_plan_));
    window_state_bytes_ = PrefillWindowStateBytes(*kernel_plan_, geometry_, max_chunk_);
    ATTND_ASSIGN_OR_RETURN(d_window_state_,
                           DeviceAlloc(window_state_bytes_, "prefill window state"));
    spdlog::info(
        "cuda engine: prefill steps of {} key tiles ({} keys) per block, {:.1f} MiB of window "
        "state; decode on the higher-priority stream",
        window_tiles_, window_tiles_ * PrefillKeyTileKeys(*kernel_plan_),
        static_cast<double>(window_state_bytes_) / 1048576.0);
  }
  ATTND_ASSIGN_OR_RETURN(h_table_, PinnedAlloc(layout_.num_pages * 4, "page table"));
  ATTND_ASSIGN_OR_RETURN(d_table_, DeviceAlloc(layout_.num_pages * 4, "page table"));
  if (sparse_ != nullptr) {
    // One size for every step of every call: a piece anywhere in the longest sequence the pool
    // holds, its block lists stored for one attention chunk of at most max_chunk_ rows.
    const int64_t longest = layout_.num_pages * layout_.page_size;
    for (int32_t layer = 0; layer < layout_.num_layers; ++layer) {
      const size_t bytes =
          SparsePrefillWorkspaceBound(geometry_, sparse_->layer(layer), longest, max_chunk_,
                                      sparse_->last_q, SparseRowBlockSlice());
      if (bytes == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda engine: the sparse attention config of layer ", layer, " is not supported"));
      }
      sparse_workspace_bytes_ = std::max(sparse_workspace_bytes_, bytes);
    }
    ATTND_ASSIGN_OR_RETURN(d_sparse_workspace_,
                           DeviceAlloc(sparse_workspace_bytes_, "the sparse prefill workspace"));
  }

  const int64_t b = max_decode_batch_;
  step_ = CudaDecodeStepLayout::For(*kernel_plan_, static_cast<int32_t>(b), layout_.num_pages,
                                    layout_.page_size);
  if (scaled_kv()) {
    // The prefill kernels read bf16: a call's keys [0, start + tokens) are dequantised into this
    // scratch first (DequantizePrefix), sized for the longest sequence the pool holds, and read
    // through an identity page table. Decode reads the pool's codes itself; its new rows pass
    // through d_kv_rows_ on their way to the quantiser.
    const int64_t row_elems = step_.max_length * hkv * d;
    ATTND_ASSIGN_OR_RETURN(d_dequant_,
                           DeviceAlloc(2 * row_elems * 2, "the scaled KV's prefill scratch"));
    std::vector<int32_t> identity(layout_.num_pages);
    std::iota(identity.begin(), identity.end(), 0);
    ATTND_ASSIGN_OR_RETURN(d_identity_, DeviceAlloc(identity.size() * 4, "the scratch pages"));
    ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_identity_.get(), identity.data(), identity.size() * 4,
                                          cudaMemcpyHostToDevice));
    ATTND_ASSIGN_OR_RETURN(d_kv_rows_, DeviceAlloc(b * 2 * hkv * d * 4, "decode rows to quantise"));
    spdlog::info(
        "cuda engine: {} KV; the prefill kernels read a bf16 scratch of {:.1f} MiB ({} tokens, "
        "the longest sequence the pool holds), refilled from the pool per prefill chunk",
        std::string(DTypeName(layout_.kv_dtype)),
        static_cast<double>(2 * row_elems * 2) / 1048576.0, step_.max_length);
  }
  ATTND_ASSIGN_OR_RETURN(h_decode_, PinnedAlloc(step_.host_bytes, "decode staging"));
  ATTND_ASSIGN_OR_RETURN(d_decode_, DeviceAlloc(step_.device_bytes, "decode inputs"));
  ATTND_ASSIGN_OR_RETURN(h_tables_, PinnedAlloc(step_.table_bytes, "decode page tables"));
  ATTND_ASSIGN_OR_RETURN(d_tables_, DeviceAlloc(step_.table_bytes, "decode page tables"));
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d_tables_.get(), 0, step_.table_bytes, stream_));
  ATTND_ASSIGN_OR_RETURN(h_decode_out_, PinnedAlloc(step_.output_bytes, "decode output"));
  ATTND_ASSIGN_OR_RETURN(d_row_outs_, DeviceAlloc(b * sizeof(DecodeRowOut), "decode row outputs"));
  ATTND_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&visible_devices_));
  ATTND_ASSIGN_OR_RETURN(d_workspace_, DeviceAlloc(step_.workspace_floats * 4, "decode workspace"));
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (use_graphs_ && !sizes_.empty()) ATTND_RETURN_IF_ERROR(CaptureDecodeGraphs());
  return absl::OkStatus();
}

absl::Status CudaEngine::CaptureDecodeGraphs() {
  size_t free_before = 0, free_after = 0, total = 0;
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_before, &total));
  const auto t0 = std::chrono::steady_clock::now();
  graphs_.reserve(sizes_.size() * layout_.num_layers);
  for (int32_t size : sizes_) {
    for (int32_t layer = 0; layer < layout_.num_layers; ++layer) {
      ATTND_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      const absl::Status enqueued = EnqueueDecodeStep(layer, size, size);
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
      if (!enqueued.ok()) {
        if (graph != nullptr) cudaGraphDestroy(graph);
        return enqueued;
      }
      ATTND_CUDA_RETURN_IF_ERROR(ended);
      cudaGraphExec_t exec = nullptr;
      const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      ATTND_CUDA_RETURN_IF_ERROR(instantiated);
      graphs_.push_back(exec);
      ATTND_CUDA_RETURN_IF_ERROR(cudaGraphUpload(exec, stream_));
    }
  }
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total));
  spdlog::info(
      "cuda engine: captured {} decode graphs ({} sizes x {} layers, sizes {}..{}) in "
      "{:.1f} ms, {:.1f} MiB of device memory",
      graphs_.size(), sizes_.size(), layout_.num_layers, sizes_.front(), sizes_.back(), ms,
      (static_cast<double>(free_before) - static_cast<double>(free_after)) / 1048576.0);
  return absl::OkStatus();
}

CudaEngine::~CudaEngine() {
  MutexLock lock(&mu_);
  MutexLock prefill_lock(&prefill_mu_);
  if (prefill_stream_ != nullptr) {
    cudaStreamSynchronize(prefill_stream_);
    cudaStreamDestroy(prefill_stream_);
  }
  DestroyGreenContext(prefill_green_);
  for (cudaEvent_t event : prefill_done_) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    for (cudaGraphExec_t exec : graphs_) cudaGraphExecDestroy(exec);
    cudaStreamDestroy(stream_);
  }
  if (decode_tail_ != nullptr) cudaEventDestroy(decode_tail_);
  MutexLock gates(&gates_mu_);
  if (gate_words_ != nullptr) cudaFreeHost(gate_words_);
}

absl::Status CudaEngine::CheckPages(int32_t layer, const int32_t* page_table, int64_t num_pages,
                                    int64_t length) const {
  // The kernels index the pool without bounds checks, so a bad table must never reach them.
  if (layer < 0 || layer >= layout_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine: layer ", layer, " is not in [0, ", layout_.num_layers, ")"));
  }
  if (num_pages * layout_.page_size < length || (num_pages > 0 && page_table == nullptr) ||
      num_pages > layout_.num_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine: ", num_pages, " pages do not cover ", length, " tokens"));
  }
  for (int64_t i = 0; i < num_pages; ++i) {
    if (page_table[i] < 0 || page_table[i] >= layout_.num_pages) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine: page id ", page_table[i], " is not in the pool"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::CheckLayout(QLayout layout) const {
  if (layout == QLayout::kVariants) return absl::OkStatus();
  if (layout == QLayout::kPreRotary && !inv_freq_.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("engine: q layout ", static_cast<int32_t>(layout),
                   layout == QLayout::kPreRotary ? " needs a model with a rotary" : " is unknown"));
}

template <typename KvT>
PagedKv<KvT> CudaEngine::LayerView(int32_t layer, const int32_t* device_page_table) const {
  PagedKv<KvT> kv;
  char* const base = static_cast<char*>(pool_.get());
  kv.k = reinterpret_cast<KvT*>(base + layout_.k_offset(layer));
  kv.v = reinterpret_cast<KvT*>(base + layout_.v_offset(layer));
  kv.page_table = device_page_table;
  kv.page_size = layout_.page_size;
  kv.num_kv_heads = layout_.num_kv_heads;
  kv.head_dim = layout_.head_dim;
  if (HasRowScale(layout_.kv_dtype)) {
    kv.k_scale = reinterpret_cast<float*>(base + layout_.k_scale_offset(layer));
    kv.v_scale = reinterpret_cast<float*>(base + layout_.v_scale_offset(layer));
  }
  return kv;
}

PagedKv<Bf16> CudaEngine::PrefillView(int32_t layer, const int32_t* device_page_table) const {
  if (!scaled_kv()) return LayerView<Bf16>(layer, device_page_table);
  PagedKv<Bf16> kv;
  kv.k = static_cast<Bf16*>(d_dequant_.get());
  kv.v = kv.k + step_.max_length * layout_.num_kv_heads * layout_.head_dim;
  kv.page_table = static_cast<const int32_t*>(d_identity_.get());
  kv.page_size = layout_.page_size;
  kv.num_kv_heads = layout_.num_kv_heads;
  kv.head_dim = layout_.head_dim;
  return kv;
}

absl::Status CudaEngine::DequantizePrefix(int32_t layer, int64_t length) {
  if (!scaled_kv()) return absl::OkStatus();
  const PagedKv<Bf16> scratch = PrefillView(layer, nullptr);
  return WithCodes([&](auto code) {
    using CodeT = decltype(code);
    CudaDequantizeKvParamsOf<CodeT> dp;
    dp.kv = LayerView<CodeT>(layer, static_cast<const int32_t*>(d_table_.get()));
    dp.k_out = scratch.k;
    dp.v_out = scratch.v;
    dp.num_tokens = length;
    return LaunchDequantizeKv(dp, prefill_stream_);
  });
}

absl::Status CudaEngine::CheckPrefillJob(const PrefillJob& job) const {
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const int64_t t = job.num_tokens;
  // Only what the kernels could not survive (engine.h, EngineJobKey): prompt_len >= start + t is
  // the runtime's check; it only scales keys and picks the sparse path, never indexes memory.
  if (t < 1 || job.start < 0 || job.out == nullptr || !IsKnownDType(job.out_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("engine: bad prefill range (start ", job.start,
                                                   ", tokens ", t, ", prompt_len ", job.prompt_len,
                                                   ")"));
  }
  ATTND_RETURN_IF_ERROR(CheckPages(job.layer, job.page_table, job.num_pages, job.start + t));
  ATTND_RETURN_IF_ERROR(CheckLayout(job.q_layout));
  const bool pre_rotary = job.q_layout == QLayout::kPreRotary;
  ATTND_RETURN_IF_ERROR(
      CheckElements("q", job.q, t * (pre_rotary ? 1 : kNumQueryVariants) * hq * d));
  ATTND_RETURN_IF_ERROR(CheckElements("k", job.k, t * hkv * d));
  ATTND_RETURN_IF_ERROR(CheckElements("v", job.v, t * hkv * d));
  for (const TensorView* view : {&job.q, &job.k, &job.v}) {
    if (!IsKnownDType(view->dtype)) return absl::InvalidArgumentError("engine: bad dtype");
  }
  if (pre_rotary && (job.k.dtype != job.q.dtype || job.v.dtype != job.q.dtype)) {
    return absl::InvalidArgumentError("engine: a pre-rotary prefill needs one dtype for q, k, v");
  }
  if ((job.k.on_device || job.v.on_device) && job.k.dtype != job.v.dtype) {
    return absl::InvalidArgumentError(
        "engine: k and v in device memory need one dtype (they are appended as they are)");
  }
  return absl::OkStatus();
}

// A prefill on the prefill lane, one step at a time: holds the lane from StartPrefill to its end.
class CudaEngine::PrefillSteps : public PrefillRun {
 public:
  PrefillSteps(CudaEngine* engine, const PrefillJob& job)
      : engine_(engine),
        job_(job),
        scale_(LengthScale(job.prompt_len, engine->geometry_.original_max_position_embeddings)),
        // DCA.md: sparse when the config exists and the prompt (as for scaling) exceeds the
        // threshold.
        sparse_(engine->sparse_ != nullptr && engine->sparse_->UseSparse(job.prompt_len)) {}
  ~PrefillSteps() override ABSL_NO_THREAD_SAFETY_ANALYSIS {
    // A run stopped or failed half-way may have queued work on the staging buffers: let it drain
    // before the next job reuses them. (The pages it wrote past the layer's length stay
    // uncommitted.)
    if (!clean_) cudaStreamSynchronize(engine_->prefill_stream_);
    engine_->prefill_mu_.Unlock();  // taken by StartPrefill
  }
  bool done() const override { return done_; }
  absl::Status Step() override ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (done_) return absl::FailedPreconditionError("the prefill run is done");
    clean_ = false;
    absl::Status s = CudaStatus(cudaSetDevice(engine_->device_), "cudaSetDevice");
    if (s.ok()) s = engine_->PrefillStep(job_, scale_, sparse_, &cursor_);
    if (!s.ok()) {
      done_ = true;
      return s;
    }
    done_ = cursor_.first >= job_.num_tokens;
    clean_ = cursor_.window < 0;  // between staging chunks nothing is queued
    if (done_ && job_.order != nullptr && job_.order->record != nullptr) {
      return CudaStatus(
          cudaEventRecord(static_cast<cudaEvent_t>(job_.order->record), engine_->prefill_stream_),
          "recording the client's event");
    }
    return absl::OkStatus();
  }

 private:
  CudaEngine* const engine_;
  const PrefillJob& job_;
  const float scale_;
  const bool sparse_;
  PrefillCursor cursor_;
  bool done_ = false;
  bool clean_ = true;
};

absl::StatusOr<std::unique_ptr<PrefillRun>> CudaEngine::StartPrefill(const PrefillJob& job)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  ATTND_RETURN_IF_ERROR(CheckPrefillJob(job));
  prefill_mu_.Lock();  // until the run ends
  std::unique_ptr<PrefillRun> run(new PrefillSteps(this, job));
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // A device-ordered decode may still be appending to pages this job now owns (decode_tail_).
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(prefill_stream_, decode_tail_, 0));
  std::memcpy(h_table_.get(), job.page_table, job.num_pages * 4);
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_table_.get(), h_table_.get(), job.num_pages * 4,
                                             cudaMemcpyHostToDevice, prefill_stream_));
  return run;
}

absl::Status CudaEngine::Prefill(const PrefillJob& job) {
  ATTND_ASSIGN_OR_RETURN(const std::unique_ptr<PrefillRun> run, StartPrefill(job));
  while (!run->done()) ATTND_RETURN_IF_ERROR(run->Step());
  return absl::OkStatus();
}

absl::Status CudaEngine::PrefillStep(const PrefillJob& job, float s, bool sparse,
                                     PrefillCursor* cursor) {
  const int64_t t = job.num_tokens;
  if (sparse) {  // its own chunks, in one step: its blocks are short (bounded by the budgets)
    ATTND_RETURN_IF_ERROR(PrefillSparse(job, s));
    cursor->first = t;
    return absl::OkStatus();
  }
  const int64_t first = cursor->first, count = std::min(max_chunk_, t - first);
  if (cursor->window < 0) {
    ATTND_RETURN_IF_ERROR(StageQueries(job, first, count));
    ATTND_RETURN_IF_ERROR(AppendKeys(job, first, count, s));
    // Scaled pool: every key this chunk attends, its own included, as the bf16 kernels read them;
    // the chunk's windows share it (the lane is this run's until it ends).
    ATTND_RETURN_IF_ERROR(DequantizePrefix(job.layer, job.start + first + count));
    cursor->window = 0;
  }
  CudaPrefillParams pp;
  pp.kv = PrefillView(job.layer, static_cast<const int32_t*>(d_table_.get()));
  pp.q = static_cast<const Bf16*>(d_q_bf16_.get());
  pp.out = At(d_prefill_, out_off_);
  pp.out_dtype = job.out_dtype;
  pp.start = job.start + first;
  pp.num_tokens = count;
  pp.softmax_scale = geometry_.softmax_scale * s;
  // Key-tile windows of about prefill_step_keys_ keys: no block of the step runs longer than
  // that many keys' work, the bound on a decode's wait for the device.
  const int64_t tiles = PrefillKeyTiles(*kernel_plan_, geometry_, pp.start, count);
  const int64_t per_window = window_tiles_ > 0 ? window_tiles_ : tiles;
  const int64_t windows = std::max<int64_t>(1, (tiles + per_window - 1) / per_window);
  if (windows > 1) {
    pp.key_tile_begin = static_cast<int32_t>(cursor->window * per_window);
    pp.key_tile_end = static_cast<int32_t>(std::min(tiles, (cursor->window + 1) * per_window));
    pp.window_state = d_window_state_.get();
    pp.window_state_bytes = window_state_bytes_;
  }
  ATTND_RETURN_IF_ERROR(LaunchDcaPrefill(*kernel_plan_, pp, prefill_stream_));
  // One window queued ahead of the host: the stream never runs dry, and a stopped run leaves at
  // most two windows behind.
  const int64_t w = cursor->window;
  ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(prefill_done_[w % 2], prefill_stream_));
  if (w > 0) ATTND_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(prefill_done_[(w - 1) % 2]));
  if (++cursor->window < windows) return absl::OkStatus();
  ATTND_RETURN_IF_ERROR(CopyOut(job, first, count));
  cursor->first = first + count;
  cursor->window = -1;
  return absl::OkStatus();
}

absl::Status CudaEngine::StageRows(const TensorView& view, int64_t first_row, int64_t rows,
                                   size_t h_off, void* device_dst) {
  // A shard's views have a row pitch (its heads of each row): packed densely on the way.
  const int64_t row = RowBytes(view), pitch = RowPitch(view);
  const char* src = static_cast<const char*>(view.data) + first_row * pitch;
  if (view.on_device) {
    ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(device_dst, row, src, pitch, row, rows,
                                                 cudaMemcpyDeviceToDevice, prefill_stream_));
    return absl::OkStatus();
  }
  CopyRowsToDense(view, first_row, rows, At(h_prefill_, h_off));
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_dst, At(h_prefill_, h_off), rows * row,
                                             cudaMemcpyHostToDevice, prefill_stream_));
  return absl::OkStatus();
}

absl::Status CudaEngine::StageQueries(const PrefillJob& job, int64_t first, int64_t count) {
  const int64_t hq = geometry_.num_q_heads, d = geometry_.head_dim;
  const bool pre_rotary = job.q_layout == QLayout::kPreRotary;
  // q as it arrives: the five variants, or [count, Hq, D] before the rotary.
  const int64_t q_rows = pre_rotary ? 1 : kNumQueryVariants;  // rows per token
  Bf16* q_bf16 = static_cast<Bf16*>(d_q_bf16_.get());
  if (pre_rotary) {  // staged as is; the rotary kernel writes the bf16 variants
    ATTND_RETURN_IF_ERROR(
        StageRows(job.q, first * q_rows, count * q_rows, q_off_, At(d_prefill_, q_off_)));
    CudaRotaryParams rp;
    rp.q = At(d_prefill_, q_off_);
    rp.dtype = job.q.dtype;
    rp.q_variants = q_bf16;
    rp.inv_freq = static_cast<const float*>(d_inv_freq_.get());
    rp.start = job.start + first;
    rp.num_tokens = count;
    return LaunchDualChunkRotary(geometry_, rp, prefill_stream_);
  }
  if (job.q.dtype == DType::kBf16) {  // straight into the kernels' buffer
    return StageRows(job.q, first * q_rows, count * q_rows, q_off_, q_bf16);
  }
  ATTND_RETURN_IF_ERROR(
      StageRows(job.q, first * q_rows, count * q_rows, q_off_, At(d_prefill_, q_off_)));
  return LaunchConvertToBf16(At(d_prefill_, q_off_), job.q.dtype, count * q_rows * hq * d, q_bf16,
                             prefill_stream_);
}

absl::Status CudaEngine::AppendKeys(const PrefillJob& job, int64_t first, int64_t count, float s) {
  const int64_t kv_n = count * geometry_.num_kv_heads * geometry_.head_dim;
  // k and v regions are adjacent in both mirrors only per tensor; copy each.
  ATTND_RETURN_IF_ERROR(StageRows(job.k, first, count, k_off_, At(d_prefill_, k_off_)));
  ATTND_RETURN_IF_ERROR(StageRows(job.v, first, count, v_off_, At(d_prefill_, v_off_)));
  if (job.q_layout == QLayout::kPreRotary) {
    // k rotated in place (its own dtype) before the append scales it: DCA.md rotates the raw
    // key, then length-scales it.
    CudaRotaryParams rp;
    rp.k = At(d_prefill_, k_off_);
    rp.dtype = job.k.dtype;
    rp.inv_freq = static_cast<const float*>(d_inv_freq_.get());
    rp.start = job.start + first;
    rp.num_tokens = count;
    ATTND_RETURN_IF_ERROR(LaunchDualChunkRotary(geometry_, rp, prefill_stream_));
  }
  CudaAppendParams ap;
  ap.kv = LayerView<Bf16>(job.layer, static_cast<const int32_t*>(d_table_.get()));
  ap.k = At(d_prefill_, k_off_);
  ap.v = At(d_prefill_, v_off_);
  ap.in_dtype = job.k.dtype;
  ap.start = job.start + first;
  ap.num_tokens = count;
  ap.key_scale = s;
  if (job.k.dtype != job.v.dtype) {  // rare: different k and v dtypes; both to fp32 on the host
    scratch_.resize(2 * kv_n);
    ConvertToFloat(At(h_prefill_, k_off_), job.k.dtype, kv_n, scratch_.data());
    ConvertToFloat(At(h_prefill_, v_off_), job.v.dtype, kv_n, scratch_.data() + kv_n);
    ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(prefill_stream_));  // staging reuse below
    std::memcpy(At(h_prefill_, k_off_), scratch_.data(), kv_n * 4);
    std::memcpy(At(h_prefill_, v_off_), scratch_.data() + kv_n, kv_n * 4);
    ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At(d_prefill_, k_off_), At(h_prefill_, k_off_),
                                               kv_n * 4, cudaMemcpyHostToDevice, prefill_stream_));
    ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At(d_prefill_, v_off_), At(h_prefill_, v_off_),
                                               kv_n * 4, cudaMemcpyHostToDevice, prefill_stream_));
    ap.in_dtype = DType::kFp32;
  }
  if (scaled_kv()) {  // the same rows, quantised (base/int8_kv.h, base/fp8.h) as the CPU engine
    return WithCodes([&](auto code) {
      using CodeT = decltype(code);
      CudaAppendParamsOf<CodeT> ac;
      ac.kv = LayerView<CodeT>(job.layer, ap.kv.page_table);
      ac.k = ap.k;
      ac.v = ap.v;
      ac.in_dtype = ap.in_dtype;
      ac.start = ap.start;
      ac.num_tokens = ap.num_tokens;
      ac.key_scale = ap.key_scale;
      return LaunchAppendKv(ac, prefill_stream_);
    });
  }
  return LaunchAppendKv(ap, prefill_stream_);
}

absl::Status CudaEngine::CopyOut(const PrefillJob& job, int64_t first, int64_t count) {
  const size_t out_row = geometry_.num_q_heads * geometry_.head_dim * ElementSize(job.out_dtype);
  const size_t out_bytes = count * out_row;
  const size_t out_pitch = job.out_row_pitch != 0 ? job.out_row_pitch : out_row;
  char* out = static_cast<char*>(job.out) + first * out_pitch;
  if (job.out_on_device) {  // straight into the client's buffer
    ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(out, out_pitch, At(d_prefill_, out_off_), out_row,
                                                 out_row, count, cudaMemcpyDeviceToDevice,
                                                 prefill_stream_));
    ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(prefill_stream_));
    return absl::OkStatus();
  }
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At(h_prefill_, out_off_), At(d_prefill_, out_off_),
                                             out_bytes, cudaMemcpyDeviceToHost, prefill_stream_));
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(prefill_stream_));
  const char* staged = static_cast<const char*>(At(h_prefill_, out_off_));  // dense
  if (out_pitch == out_row) {
    std::memcpy(out, staged, out_bytes);
  } else {
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(out + i * out_pitch, staged + i * out_row, out_row);
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::PrefillSparse(const PrefillJob& job, float s) {
  SparsePrefillParams sp;
  sp.prefill.kv = PrefillView(job.layer, static_cast<const int32_t*>(d_table_.get()));
  sp.prefill.q = static_cast<const Bf16*>(d_q_bf16_.get());
  sp.prefill.out = At(d_prefill_, out_off_);
  sp.prefill.out_dtype = job.out_dtype;
  sp.prefill.softmax_scale = geometry_.softmax_scale * s;
  sp.budgets = sparse_->layer(job.layer);
  sp.last_q = sparse_->last_q;
  sp.workspace = d_sparse_workspace_.get();
  sp.workspace_bytes = sparse_workspace_bytes_;
  sp.row_block_slice = SparseRowBlockSlice();
  // Each staging step reuses h_prefill_, which the previous step's queued copy may still read.
  const auto wait = [this]() {
    return CudaStatus(cudaStreamSynchronize(prefill_stream_), "stream sync");
  };
  // The staged queries hold the call's tokens [first, first + count): positions from job.start.
  const auto stage = [&](int64_t first, int64_t count) -> absl::Status {
    ATTND_RETURN_IF_ERROR(wait());
    ATTND_RETURN_IF_ERROR(StageQueries(job, first, count));
    sp.prefill.start = job.start + first;
    sp.prefill.num_tokens = count;
    return absl::OkStatus();
  };
  for (const VsPiece& piece : SplitIntoPieces(job.start, job.num_tokens, geometry_.chunk_len)) {
    const int64_t begin = piece.begin - job.start, rows = piece.end - piece.begin;
    // The estimate scores the piece's last queries against all its keys [0, end).
    for (int64_t first = 0; first < rows; first += max_chunk_) {
      ATTND_RETURN_IF_ERROR(wait());
      ATTND_RETURN_IF_ERROR(AppendKeys(job, begin + first, std::min(max_chunk_, rows - first), s));
    }
    // Scaled pool: the keys the piece's estimate and attention read, [0, piece end), into the
    // scratch.
    ATTND_RETURN_IF_ERROR(DequantizePrefix(job.layer, piece.end));
    // Attention chunks: the whole piece when the buffers hold it, else the fewest chunks of whole
    // row blocks, of even size (no small tail launch). The last one first, so that the estimate
    // reads its queries there when it holds all of them (always for a piece staged once), else
    // from their own staging.
    const int64_t chunks = rows <= max_chunk_ ? 1 : (rows + sparse_rows_ - 1) / sparse_rows_;
    const int64_t per_chunk =
        chunks == 1 ? rows : ((rows + chunks - 1) / chunks + kVsBlock - 1) / kVsBlock * kVsBlock;
    const int64_t last = (chunks - 1) * per_chunk;
    const int64_t n_est = std::min(rows, sparse_->last_q);
    const bool est_in_last = rows - last >= n_est;
    if (!est_in_last) {
      ATTND_RETURN_IF_ERROR(stage(begin + rows - n_est, n_est));
      ATTND_RETURN_IF_ERROR(LaunchSparseEstimate(geometry_, sp, piece, prefill_stream_));
    }
    for (int64_t i = 0; i < chunks; ++i) {
      const int64_t first = i == 0 ? last : (i - 1) * per_chunk;
      const int64_t count = std::min(per_chunk, rows - first);
      ATTND_RETURN_IF_ERROR(stage(begin + first, count));
      if (i == 0 && est_in_last) {
        ATTND_RETURN_IF_ERROR(LaunchSparseEstimate(geometry_, sp, piece, prefill_stream_));
      }
      ATTND_RETURN_IF_ERROR(
          LaunchSparseAttendRows(geometry_, sp, piece, first, count, prefill_stream_));
      ATTND_RETURN_IF_ERROR(CopyOut(job, begin + first, count));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::CheckDecodeJob(const DecodeJob& job) const {
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const int64_t q_n = kNumDecodeVariants * hq * d, kv_n = hkv * d;
  for (const DecodeJob::Entry& e : job.entries) {
    if (e.length < 1 || e.out == nullptr || !IsKnownDType(e.out_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("engine: bad decode length ", e.length));
    }
    ATTND_RETURN_IF_ERROR(CheckPages(job.layer, e.page_table, e.num_pages, e.length));
    ATTND_RETURN_IF_ERROR(CheckLayout(e.q_layout));
    if (e.q_layout == QLayout::kPreRotary) {
      ATTND_RETURN_IF_ERROR(CheckElements("q", e.q, hq * d));
    } else if (e.q.data == nullptr || NumElements(e.q) < q_n) {
      // q may carry 3 or 5 variants; the first three are contiguous at the front.
      return absl::InvalidArgumentError("engine: decode q has fewer than 3 variants");
    }
    ATTND_RETURN_IF_ERROR(CheckElements("k", e.k, kv_n));
    ATTND_RETURN_IF_ERROR(CheckElements("v", e.v, kv_n));
    for (const TensorView* view : {&e.q, &e.k, &e.v}) {
      if (!IsKnownDType(view->dtype)) return absl::InvalidArgumentError("engine: bad dtype");
    }
    // The step's kernels read device tensors in place, an element at a time at worst: each must
    // be aligned to its dtype (a region reference's offset is, docs/regions.md).
    const auto misaligned = [](const void* p, int64_t pitch, DType dtype) {
      const int64_t size = ElementSize(dtype);
      return reinterpret_cast<uintptr_t>(p) % size != 0 || pitch % size != 0;
    };
    const std::pair<const char*, const TensorView*> views[] = {
        {"q", &e.q}, {"k", &e.k}, {"v", &e.v}};
    for (const auto& [name, view] : views) {
      if (view->on_device && misaligned(view->data, view->row_pitch, view->dtype)) {
        return absl::InvalidArgumentError(absl::StrCat("engine: device tensor ", name, " (",
                                                       DTypeName(view->dtype), ", row pitch ",
                                                       view->row_pitch, ") is not aligned to its ",
                                                       ElementSize(view->dtype), "-byte elements"));
      }
    }
    if (e.out_on_device && misaligned(e.out, 0, e.out_dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine: the device output (", DTypeName(e.out_dtype),
                       ") is not aligned to its ", ElementSize(e.out_dtype), "-byte elements"));
    }
  }
  return absl::OkStatus();
}

bool CudaEngine::OnThisDevice(const void* p) const {
  if (visible_devices_ == 1) return true;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky; the copy that follows reports a bad pointer
    return false;
  }
  return attr.type == cudaMemoryTypeDevice && attr.device == device_;
}

// A started decode: holds the engine's lock from DecodeLaunch until DecodeFinish.
class CudaEngine::Pending : public PendingDecode {
 public:
  Pending(CudaEngine* engine, const DecodeJob* job, DecodeStats stats)
      : engine_(engine), job_(job), stats_(stats) {}
  ~Pending() override {
    if (engine_ != nullptr) Finish().IgnoreError();
  }
  absl::StatusOr<DecodeStats> Finish() override ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (engine_ == nullptr) return absl::FailedPreconditionError("decode already finished");
    CudaEngine* engine = std::exchange(engine_, nullptr);
    const absl::Status s = engine->DecodeFinish(*job_, 0, job_->entries.size());
    engine->mu_.Unlock();  // taken by StartDecode
    if (!s.ok()) return s;
    return stats_;
  }

 private:
  CudaEngine* engine_;  // null once finished
  const DecodeJob* const job_;
  const DecodeStats stats_;
};

absl::StatusOr<std::unique_ptr<PendingDecode>> CudaEngine::StartDecode(const DecodeJob& job)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  ATTND_RETURN_IF_ERROR(CheckDecodeJob(job));
  if (job.entries.empty() || job.entries.size() > static_cast<size_t>(max_decode_batch_)) {
    return std::unique_ptr<PendingDecode>();
  }
  mu_.Lock();  // until Pending::Finish
  DecodeStats stats;
  absl::Status s = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
  if (s.ok()) s = DecodeLaunch(job, 0, job.entries.size(), &stats);
  if (!s.ok()) {
    // A launch that failed half-way may still have queued work: let it drain before the buffers
    // are reused.
    cudaStreamSynchronize(stream_);
    mu_.Unlock();
    return s;
  }
  return std::unique_ptr<PendingDecode>(new Pending(this, &job, stats));
}

absl::StatusOr<DecodeStats> CudaEngine::Decode(const DecodeJob& job) {
  ATTND_RETURN_IF_ERROR(CheckDecodeJob(job));
  DecodeStats stats;
  if (job.entries.empty()) return stats;
  MutexLock lock(&mu_);
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  for (size_t first = 0; first < job.entries.size(); first += max_decode_batch_) {
    ATTND_RETURN_IF_ERROR(DecodeBatch(
        job, first, std::min<size_t>(max_decode_batch_, job.entries.size() - first), &stats));
  }
  return stats;
}

absl::StatusOr<DeviceMemoryOpener::Mapping> CudaEngine::OpenIpcHandle(absl::string_view handle) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle is ", sizeof(h), " bytes"));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  void* ptr = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot open the CUDA IPC handle on ", device_name_, " (", device_uuid_,
        "): ", cudaGetErrorString(err),
        " (the exporting process must run on this host, on this GPU, and keep the memory)"));
  }
  Mapping m;
  m.device_ptr = ptr;
  unsigned long long base = 0;  // NOLINT(runtime/int)
  size_t size = 0;
  const GetAddressRangeFn range = AddressRangeFn();
  if (range == nullptr || range(&base, &size, reinterpret_cast<unsigned long long>(ptr)) != 0) {
    cudaIpcCloseMemHandle(ptr);
    return absl::InternalError("cannot query the size of the CUDA IPC allocation");
  }
  m.bytes = base + size - reinterpret_cast<unsigned long long>(ptr);
  return m;
}

void CudaEngine::CloseIpcHandle(void* device_ptr) {
  cudaSetDevice(device_);
  cudaEventSynchronize(decode_tail_);  // a device-ordered step may still read or write it
  cudaIpcCloseMemHandle(device_ptr);
}

absl::StatusOr<bool> CudaEngine::IpcEventDone(void* event) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) return false;
  cudaGetLastError();
  return CudaStatus(err, "cudaEventQuery of the ring's ready event");
}

absl::StatusOr<DeviceMemoryOpener::IpcEvent> CudaEngine::CreateIpcEvent() {
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaEvent_t event = nullptr;
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcEventHandle_t handle;
  const cudaError_t err = cudaIpcGetEventHandle(&handle, event);
  if (err != cudaSuccess) {
    cudaEventDestroy(event);
    return CudaStatus(err, "cudaIpcGetEventHandle");
  }
  IpcEvent out;
  out.event = event;
  out.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  return out;
}

void CudaEngine::DestroyIpcEvent(void* event) {
  cudaSetDevice(device_);
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

namespace {
constexpr int32_t kGateSlots = 4096;  // open device-ordered rings at once, with a gate each
}  // namespace

absl::StatusOr<DeviceMemoryOpener::Gate> CudaEngine::CreateGate() {
  MutexLock lock(&gates_mu_);
  if (!gates_status_) {
    gates_status_ = [&]() -> absl::Status {
      ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
      int mem_ops = 0;
      if (!DriverDeviceAttribute(device_, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                 &mem_ops) ||
          mem_ops == 0) {
        return absl::FailedPreconditionError(
            "the device or driver has no 64-bit stream memory operations");
      }
      wait_value_ = DriverFunction<StreamValueFn>("cuStreamWaitValue64", CUDA_VERSION);
      write_value_ = DriverFunction<StreamValueFn>("cuStreamWriteValue64", CUDA_VERSION);
      if (wait_value_ == nullptr || write_value_ == nullptr) {
        return absl::FailedPreconditionError("the driver has no cuStreamWaitValue64");
      }
      void* words = nullptr;
      ATTND_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&words, kGateSlots * sizeof(uint64_t),
                                               cudaHostAllocMapped | cudaHostAllocPortable));
      std::memset(words, 0, kGateSlots * sizeof(uint64_t));
      gate_words_ = static_cast<uint64_t*>(words);
      for (int32_t i = kGateSlots - 1; i >= 0; --i) free_gates_.push_back(i);
      return absl::OkStatus();
    }();
    if (gates_status_->ok()) {
      spdlog::info(
          "cuda engine: device-ordered rings wait for their clients on the device, behind "
          "gates attnd can open itself");
      if (!cuda_mps_) {
        spdlog::warn(
            "cuda engine: a device-ordered ring while attnd is not under CUDA MPS: the client's "
            "process and attnd take turns on the GPU in time slices, and each ordered step waits "
            "for one (0.3 ms at batch 1 on an H100, 0.06 ms under MPS); run both under MPS "
            "(docs/operations.md)");
      }
    } else {
      spdlog::info("cuda engine: device-ordered rings wait for their clients on the host ({})",
                   gates_status_->ToString());
    }
  }
  ATTND_RETURN_IF_ERROR(*gates_status_);
  if (free_gates_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", kGateSlots, " device gates are in use"));
  }
  Gate gate;
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaStream_t stream = nullptr;
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  gate.slot = free_gates_.back();
  free_gates_.pop_back();
  gate.stream = stream;
  gate.word = gate_words_ + gate.slot;
  void* device_word = nullptr;
  if (cudaError_t err = cudaHostGetDevicePointer(&device_word, gate.word, 0); err != cudaSuccess) {
    cudaStreamDestroy(stream);
    free_gates_.push_back(gate.slot);
    return CudaStatus(err, "cudaHostGetDevicePointer of a gate word");
  }
  gate.device_word = device_word;
  gate.value = __atomic_load_n(gate.word, __ATOMIC_ACQUIRE);
  return gate;
}

absl::Status CudaEngine::ArmGate(const Gate& gate, void* ready_event, uint64_t value) {
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const auto stream = static_cast<cudaStream_t>(gate.stream);
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(ready_event), 0));
  // The default write orders the client's writes (complete at its event) before the word.
  if (CUresult r = write_value_(reinterpret_cast<CUstream>(stream),
                                reinterpret_cast<CUdeviceptr>(gate.device_word), value, 0);
      r != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuStreamWriteValue64 on a ring's gate failed (CUresult ", r, ")"));
  }
  return absl::OkStatus();
}

void CudaEngine::DestroyGate(const Gate& gate, bool stuck) {
  cudaSetDevice(device_);
  // A stream with work still queued is released once that work is done.
  cudaStreamDestroy(static_cast<cudaStream_t>(gate.stream));
  MutexLock lock(&gates_mu_);
  if (stuck) {
    spdlog::warn("cuda engine: gate {} retired: its client's stream never reached its event",
                 gate.slot);
    return;
  }
  free_gates_.push_back(gate.slot);
}

absl::Status CudaEngine::EnqueueDecodeStep(int32_t layer, int32_t rows, int32_t plan) {
  char* base = static_cast<char*>(pool_.get());
  CudaDecodeStepParams p;
  p.kv_dtype = layout_.kv_dtype;
  p.k = base + layout_.k_offset(layer);
  p.v = base + layout_.v_offset(layer);
  if (scaled_kv()) {
    p.k_scale = reinterpret_cast<float*>(base + layout_.k_scale_offset(layer));
    p.v_scale = reinterpret_cast<float*>(base + layout_.v_scale_offset(layer));
    p.kv_rows = static_cast<float*>(d_kv_rows_.get());
  }
  p.page_size = layout_.page_size;
  p.host = h_decode_.get();
  p.host_tables = static_cast<const int32_t*>(h_tables_.get());
  p.device_tables = static_cast<int32_t*>(d_tables_.get());
  p.device = d_decode_.get();
  p.out = static_cast<float*>(h_decode_out_.get());
  p.workspace = static_cast<float*>(d_workspace_.get());
  p.row_outs = static_cast<DecodeRowOut*>(d_row_outs_.get());
  p.inv_freq = static_cast<const float*>(d_inv_freq_.get());  // null: no rotary in the model
  p.rows = rows;
  p.planned_batch = plan;
  return LaunchDecodeStep(*kernel_plan_, step_, p, stream_);
}

absl::Status CudaEngine::DecodeBatch(const DecodeJob& job, size_t first, size_t count,
                                     DecodeStats* stats) {
  ATTND_RETURN_IF_ERROR(DecodeLaunch(job, first, count, stats));
  return DecodeFinish(job, first, count);
}

absl::Status CudaEngine::DecodeLaunch(const DecodeJob& job, size_t first, size_t count,
                                      DecodeStats* stats) {
  const int64_t hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const int64_t kv_n = hkv * d, out_n = int64_t{geometry_.num_q_heads} * d;
  const int32_t b = static_cast<int32_t>(count);
  const auto size = std::lower_bound(sizes_.begin(), sizes_.end(), b);
  const int32_t plan = size == sizes_.end() ? b : *size;
  const bool replay = !graphs_.empty() && size != sizes_.end();
  if (decode_in_flight_) {  // its kernels still read the row table rewritten below
    ATTND_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(decode_tail_));
    decode_in_flight_ = false;
  }
  // Only copies on the host, of host tensors: each row's tensors in their own dtype (the stage
  // kernel converts). A device tensor's address goes in the row's DecodeStageRow and the kernels
  // read it (and write a device output) in place: no copies, no synchronisation, and the
  // captured graphs, which read the row table at run time, serve any mix of host and device rows.
  DecodeStageRow* rows = static_cast<DecodeStageRow*>(h_decode_.get());
  int32_t* tables = static_cast<int32_t*>(h_tables_.get());
  // Per row: which inputs live on another GPU (bit 0 q, 1 k, 2 v), copied into the slots below.
  std::vector<uint8_t> copy_in(b, 0);
  copy_out_.assign(b, 0);
  auto pack = [&](int64_t i) {
    const DecodeJob::Entry& e = job.entries[first + i];
    DecodeStageRow row;
    row.length = static_cast<int32_t>(e.length);
    row.num_pages = static_cast<int32_t>(e.num_pages);
    // A pre-rotary row's q is [Hq, D] (one variant's worth): the stage kernel turns it into the
    // three bf16 variants and rotates k before appending it (DecodeStageRow::rotary).
    const bool rotary = e.q_layout == QLayout::kPreRotary;
    row.rotary = rotary ? 1 : 0;
    row.q_dtype = static_cast<int32_t>(e.q.dtype);
    row.k_dtype = static_cast<int32_t>(e.k.dtype);
    row.v_dtype = static_cast<int32_t>(e.v.dtype);
    if (!e.q.on_device) {
      CopyRowsToDense(e.q, 0, rotary ? 1 : kNumDecodeVariants,
                      At(h_decode_, step_.host_q + i * step_.q_slot));
    } else if (OnThisDevice(e.q.data)) {
      row.q = e.q.data;
      row.q_pitch = RowPitch(e.q);
    } else {
      copy_in[i] |= 1;
    }
    if (!e.k.on_device) {
      std::memcpy(At(h_decode_, step_.host_k + i * step_.kv_slot), e.k.data,
                  kv_n * ElementSize(e.k.dtype));
    } else if (OnThisDevice(e.k.data)) {
      row.k = e.k.data;
    } else {
      copy_in[i] |= 2;
    }
    if (!e.v.on_device) {
      std::memcpy(At(h_decode_, step_.host_v + i * step_.kv_slot), e.v.data,
                  kv_n * ElementSize(e.v.dtype));
    } else if (OnThisDevice(e.v.data)) {
      row.v = e.v.data;
    } else {
      copy_in[i] |= 4;
    }
    if (e.out_on_device && OnThisDevice(e.out)) {
      row.out = e.out;
      row.out_dtype = static_cast<int32_t>(e.out_dtype);
    } else if (e.out_on_device) {
      copy_out_[i] = 1;
    } else {
      // A host output is written in its own dtype into the row's pinned slot (the kernels store
      // through the slot's mapped address), so the bus carries bf16 rather than fp32 and the
      // host only copies it out.
      row.out = At(h_decode_out_, static_cast<size_t>(i) * out_n * sizeof(float));
      row.out_dtype = static_cast<int32_t>(e.out_dtype);
    }
    rows[i] = row;
    std::memcpy(tables + i * step_.table_stride, e.page_table, e.num_pages * 4);
  };
  int32_t host_rows = 0;
  for (size_t i = first; i < first + count; ++i) {
    const DecodeJob::Entry& e = job.entries[i];
    host_rows += !e.q.on_device || !e.k.on_device || !e.v.on_device;
  }
  if (host_rows >= kParallelCopyRows) {
    copy_pool_.ParallelFor(b, pack);
  } else {
    for (int32_t i = 0; i < b; ++i) pack(i);
  }
  for (int32_t i = b; i < plan; ++i) rows[i] = DecodeStageRow();  // padding: length 0, skipped
  // Device-ordered rows behind a ring's gate: the step waits until the client's inputs are written
  // (a batch may merge several calls, each with its gate, in runs).
  const void* last_word = nullptr;
  for (size_t i = first; i < first + count; ++i) {
    const DeviceOrder* order = job.entries[i].order;
    if (order == nullptr || order->wait_word == nullptr || order->wait_word == last_word) continue;
    last_word = order->wait_word;
    if (CUresult r = wait_value_(reinterpret_cast<CUstream>(stream_),
                                 reinterpret_cast<CUdeviceptr>(order->wait_word), order->wait_value,
                                 CU_STREAM_WAIT_VALUE_GEQ);
        r != CUDA_SUCCESS) {
      return absl::InternalError(
          absl::StrCat("cuStreamWaitValue64 on a ring's gate failed (CUresult ", r, ")"));
    }
  }
  // Inputs on another GPU: copied into the row's slots on the stream, ahead of the step.
  for (int32_t i = 0; i < b; ++i) {
    if (copy_in[i] == 0) continue;
    const DecodeJob::Entry& e = job.entries[first + i];
    if (copy_in[i] & 1) {
      const int64_t n = e.q_layout == QLayout::kPreRotary ? 1 : kNumDecodeVariants;
      ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(At(h_decode_, step_.host_q + i * step_.q_slot),
                                                   RowBytes(e.q), e.q.data, RowPitch(e.q),
                                                   RowBytes(e.q), n, cudaMemcpyDefault, stream_));
    }
    if (copy_in[i] & 2) {
      ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At(h_decode_, step_.host_k + i * step_.kv_slot),
                                                 e.k.data, kv_n * ElementSize(e.k.dtype),
                                                 cudaMemcpyDefault, stream_));
    }
    if (copy_in[i] & 4) {
      ATTND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At(h_decode_, step_.host_v + i * step_.kv_slot),
                                                 e.v.data, kv_n * ElementSize(e.v.dtype),
                                                 cudaMemcpyDefault, stream_));
    }
  }
  if (replay) {
    const size_t index = static_cast<size_t>(size - sizes_.begin());
    ATTND_CUDA_RETURN_IF_ERROR(
        cudaGraphLaunch(graphs_[index * layout_.num_layers + job.layer], stream_));
  } else {
    ATTND_RETURN_IF_ERROR(EnqueueDecodeStep(job.layer, b, plan));
  }
  // The clients' events (device-ordered calls; a batch may merge several calls, each with its
  // event, in runs).
  const void* last = nullptr;
  for (size_t i = first; i < first + count; ++i) {
    const DeviceOrder* order = job.entries[i].order;
    if (order == nullptr || order->record == nullptr || order->record == last) continue;
    last = order->record;
    ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(order->record), stream_));
  }
  ++(replay ? stats->graph_replays : stats->eager_launches);
  stats->padding_entries += plan - b;
  return absl::OkStatus();
}

absl::Status CudaEngine::DecodeFinish(const DecodeJob& job, size_t first, size_t count) {
  const int64_t out_n = int64_t{geometry_.num_q_heads} * geometry_.head_dim;
  const int32_t b = static_cast<int32_t>(count);
  int32_t host_outs = 0, ordered = 0;
  for (size_t i = first; i < first + count; ++i) {
    const DecodeJob::Entry& e = job.entries[i];
    host_outs += !e.out_on_device;
    ordered += e.order != nullptr && e.out_on_device && copy_out_[i - first] == 0;
  }
  if (ordered == b) {
    // Every output is device memory the kernels write in place and every client waits for its
    // event: nothing is left for the host to do, so the step is left running (decode_tail_).
    ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(decode_tail_, stream_));
    decode_in_flight_ = true;
    return absl::OkStatus();
  }
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  // Host outputs are in their pinned slots in their dtype; device outputs are already written.
  const float* out = static_cast<const float*>(h_decode_out_.get());
  auto unpack = [&](int64_t i) {
    const DecodeJob::Entry& e = job.entries[first + i];
    if (!e.out_on_device) std::memcpy(e.out, out + i * out_n, out_n * ElementSize(e.out_dtype));
  };
  if (host_outs >= kParallelCopyRows) {
    copy_pool_.ParallelFor(b, unpack);
  } else if (host_outs > 0) {
    for (int32_t i = 0; i < b; ++i) unpack(i);
  }
  // Device outputs on another GPU: converted here from the same fp32 rows, then copied there.
  for (int32_t i = 0; i < b && static_cast<size_t>(i) < copy_out_.size(); ++i) {
    if (copy_out_[i] == 0) continue;
    const DecodeJob::Entry& e = job.entries[first + i];
    std::vector<uint8_t> converted(out_n * ElementSize(e.out_dtype));
    ConvertFromFloat(out + i * out_n, out_n, e.out_dtype, converted.data());
    ATTND_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(e.out, converted.data(), converted.size(), cudaMemcpyDefault));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> CudaEngine::CopyPool() {
  MutexLock lock(&mu_);
  MutexLock prefill_lock(&prefill_mu_);
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  ATTND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(prefill_stream_));
  std::vector<uint8_t> bytes(layout_.pool_bytes());
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(bytes.data(), pool_.get(), bytes.size(), cudaMemcpyDeviceToHost));
  return bytes;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(const CudaEngineOptions& options) {
  return CudaEngine::Create(options);
}

absl::StatusOr<std::vector<uint8_t>> CopyCudaPoolForTesting(Engine& engine) {
  auto* cuda = dynamic_cast<CudaEngine*>(&engine);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError("CopyCudaPoolForTesting: not an engine of CreateCudaEngine");
  }
  return cuda->CopyPool();
}

absl::Status CudaBuildStatus() { return absl::OkStatus(); }

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<int64_t> CudaFreeMemoryBytes(int32_t device) {
  ATTND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  size_t free_bytes = 0, total_bytes = 0;
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(free_bytes);
}

}  // namespace attnd
