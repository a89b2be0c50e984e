// Transformer-FSQ on the GPU (sm_90), framework-free: raw device pointers, sizes and a
// stream; launchers return an Error (error.h) and never synchronize or allocate.
//
//  - Encode: residual rows x_t (all layers of a Put / Append at once) -> packed 4-bit codes
//    in their page slots, bit for bit the codes of kernels::FsqEncodeRows (fsq.h): u = E x
//    summed over c in order in float64 (a float*float product is exact in float64, so each
//    (token, latent) chain is a float64 FMA chain), the bias added in float64, then the
//    rounding of FsqQuantizeLatent through its 15 thresholds (FsqLatentThresholds, taken
//    from the CPU definition itself), so ties and saturation match.
//  - Decode attention over fsq history pages (codes [page_size][FsqCodeBytes(G)] per layer
//    page, fsq.h): per tile of tokens the codes are unpacked into tensor-core fragments, the
//    KV head's keys W_k z + b_k rebuilt on tensor cores (never written to memory), key norm
//    and RoPE applied in FP32 registers, the group's queries scored, online softmax, and
//    the weighted codes sum_t a_t z_t accumulated per query head; the split merge applies
//    W_v and b_v once per head and writes ONE value-space part (o, lse) of each row, which
//    LaunchMergeParts (cuda_decode_attention.h) merges with the BF16 window parts
//    (LaunchBf16DecodeParts with r_k = null: FSQ models have no rotation).
//
// The codec (kernels::FsqLayerCodec, fsq.h) is passed with DEVICE pointers in it (F32, the
// layouts of fsq.h). The decoder's key weights are prepared once per layer
// (LaunchFsqPrepareDecoder) into an opaque device buffer in the precision the tensor cores
// use (cuda/fsq_decode_attention.cu says which, and the error it adds).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/error.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels::cuda {

// --- Encode ------------------------------------------------------------------------------

// Residual rows: element c of (layer l, token t) is x.data[l * x.layer_stride +
// t * x.token_stride + c] (x.head_stride unused), BF16 (x.bf16) or F32; BF16 is widened
// exactly, as RowSource::RowAsFloat does on the host.
// Codes: token t of layer l goes to slot dst.slots[t] % page_size of page
// dst.slots[t] / page_size, i.e. to dst.base + l * dst.layer_stride + page * dst.page_bytes +
// codes_offset + slot * FsqCodeBytes(G) (codes_offset: 0 for fsq pages, the BF16 K/V bytes
// of a layer page for bf16+fsq window pages). dst.num_kv_heads and dst.head_dim are unused.
// layer_codecs: [dst.num_layers] FsqLayerCodec in DEVICE memory whose encoder /
// encoder_bias point to device memory (layer l of the launch uses layer_codecs[l]); every
// entry has residual_width C and latent_width G.
// With `check`, every x row is tested as it is loaded (cuda_store_rows.h StoreCheck; row
// index layer * num_tokens + token, which = 0); a row holding a non-finite value gets the
// code z = 0 in every coordinate (nibbles 8, the unused high nibble of odd G 0) and is
// reported (faults: input kFaultKNew, the residual the keys come from). Without it a NaN
// latent sum gives z = 0 and ±Inf saturates, as the CPU encoder does.
// REQUIRES: 1 <= G <= kFsqMaxLatent, C >= 1, page_size >= 1. cudaErrorInvalidValue otherwise.
Error LaunchFsqEncodeRows(const RowBlock& x, const PagedRows& dst, int64_t codes_offset,
                          const FsqLayerCodec* layer_codecs, int32_t residual_width,
                          int32_t latent_width, cudaStream_t stream,
                          const StoreCheck* check = nullptr);

// --- Decode attention --------------------------------------------------------------------

// The largest latent width the decode attention kernel takes (its per-head accumulators of
// sum_t a_t z_t live in registers).
inline constexpr int kFsqCudaMaxLatent = 256;

// Bytes of one layer's prepared decoder (FsqPrepareDecoder's output).
size_t FsqDecoderBytes(int num_kv_heads, int head_dim, int latent_width);

// Prepares one layer's key decoder for the attention kernel from codec (device pointers:
// decoder_k, bias_k, key_norm (null = none)) into `prepared` (FsqDecoderBytes bytes, device,
// 16-byte aligned). Run once per layer (model load); the buffer stays valid while the
// codec's values do not change.
Error LaunchFsqPrepareDecoder(const FsqLayerCodec& codec, void* prepared, cudaStream_t stream);

// Workspace of LaunchFsqDecodeParts: the latent partial states of `splits` splits.
size_t FsqDecodeWorkspaceBytes(int batch, int num_q_heads, int latent_width, int splits);

// A split count that fills the GPU with one wave for this batch and context.
int FsqDecodeSplits(int batch, int num_kv_heads, int max_tokens, int num_sms);

struct FsqDecodeArgs {
  FsqLayerCodec codec;             // device pointers (decoder_v, bias_v read by the merge)
  const void* prepared = nullptr;  // LaunchFsqPrepareDecoder's buffer for this layer
  RopeSpec rope;                   // rotary_dims = 0: no RoPE
  // [batch] RoPE position of token 0 of each sequence's fsq list (device): token t of the
  // list (page t / page_size of its page table row) is at position positions[b] + t, so a
  // sink window before the history gives positions[b] = the sink's length.
  const int64_t* positions = nullptr;
  const float* q = nullptr;  // [batch][num_q_heads][head_dim] post-RoPE, NOT pre-scaled
  float softmax_scale = 0;
  int32_t splits = 1;         // >= 1, e.g. FsqDecodeSplits(...)
  void* workspace = nullptr;  // FsqDecodeWorkspaceBytes(batch, num_q_heads, G, splits)
};

// fsq pages of `list` (codes at offset 0 of each layer page, page_stride apart) -> part
// part_base of every row (rows = batch * num_q_heads; part_o [parts][rows][head_dim],
// part_lse [parts][rows], the layout of LaunchMergeParts): o = W_v zbar + b_v where zbar is
// the softmax-weighted mean code of the row, lse natural log; a row with no tokens gets
// o = 0, lse = -inf. With `merge` (not null), LaunchMergeParts follows on the stream
// (merge->r_v_t must be null for FSQ).
// REQUIRES: geo.head_dim in {64, 128, 256}, num_q_heads a multiple of num_kv_heads with
// group <= 8, 1 <= G <= kFsqCudaMaxLatent, rope.rotary_dims even and <= head_dim (a multiple
// of 16 for the half pairing), rope.scaling > 0, page_size a multiple of 16, list.pages
// 16-byte aligned and list.page_stride a multiple of 16, codec.key_norm (if set) 8-byte
// aligned. cudaErrorInvalidValue otherwise.
Error LaunchFsqDecodeParts(const PagedList& list, const DecodeGeometry& geo,
                           const FsqDecodeArgs& args, int max_tokens, float* part_o,
                           float* part_lse, int part_base, cudaStream_t stream,
                           const MergeTarget* merge = nullptr);

}  // namespace kvcd::kernels::cuda
