// FSQ paged decode attention, scalar instantiation.
#include "fsq_attention_impl.h"

namespace kvcd::kernels::internal {

void AttendFsqPagesScalar(const FsqPageTable& pages, const FsqLayerCodec& codec,
                          const RopeSpec& rope, int kv_head, const float* q, int group,
                          float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                          float* lse) {
  AttendFsqPagesImpl<FsqScalarOps>(pages, codec, rope, kv_head, q, group, softmax_scale,
                                   token_begin, token_end, o, lse);
}

}  // namespace kvcd::kernels::internal
