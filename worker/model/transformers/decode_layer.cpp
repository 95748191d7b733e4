// One Llama decoder layer of a small decode step in one call from Python
// (worker/model/transformers/llama_forward.py's decode path).
//
// At one row a layer's kernels take ~0.3 ms and the Python between them (the module calls,
// the attention wrapper's views, casts and checks) took ~0.1 ms more, a quarter of a step on
// the 2-core build machine. This calls the same kernels in the same order over the same
// tensors as the Python path (worker/model/transformers/llama_forward.py's _fused and
// paged_attention.py), so its results are that path's to the bit (a test checks it):
//   x += delta; h = RMSNorm1(x); qkv = h Wqkv; q, k = rotary(qkv); v = qkv's last part;
//   the new blocks zeroed, k and v written to their pool slots; o = decode attention;
//   x += o Wo; h = RMSNorm2(x); returns (SiLU(h Wgate) * h Wup) Wdown, the next layer's delta.
// Only for a layer whose four linears are quantized (QuantizedLinear) and a step of decode
// rows only, each of at most the quantized layers' row limit.
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// A QuantizedLinear's quantized weights: (weight, scales, bias or None), as it holds them.
using Weights = std::tuple<torch::Tensor, torch::Tensor, std::optional<torch::Tensor>>;

// A quantized linear layer, as QuantizedLinear.forward calls its kernel at a small step.
struct Linear {
  Weights w;
  bool int4;
  torch::Tensor operator()(const torch::Tensor& x) const {
    const auto& [weight, scales, bias] = w;
    return int4 ? int4_linear(x, weight, scales, bias) : int8_linear(x, weight, scales, bias);
  }
};

// One decoder layer's weights and shapes; called once per decode step.
class DecodeLayer {
 public:
  DecodeLayer(torch::Tensor norm1, double eps1, torch::Tensor norm2, double eps2,
              Weights qkv, Weights o, Weights gate_up, Weights down, bool int4,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double scale)
      : norm1_(std::move(norm1)), norm2_(std::move(norm2)), eps1_(eps1), eps2_(eps2),
        qkv_{std::move(qkv), int4}, o_{std::move(o), int4}, gate_up_{std::move(gate_up), int4},
        down_{std::move(down), int4}, heads_(heads), kv_heads_(kv_heads), dim_(head_dim),
        scale_(scale) {}

  // x [rows, hidden] (updated in place), delta [rows, hidden] or None (the first layer),
  // cos and sin [rows, head dim]; kpool and vpool the layer's [slots, kv heads, head dim];
  // slots [rows] where each row's new key goes; new_blocks the blocks this pass allocated
  // (zeroed first) or None; tables and lengths as decode_attention reads them.
  torch::Tensor forward(torch::Tensor x, std::optional<torch::Tensor> delta, torch::Tensor cos,
                        torch::Tensor sin, torch::Tensor kpool, torch::Tensor vpool,
                        torch::Tensor slots, std::optional<torch::Tensor> new_blocks,
                        torch::Tensor tables, torch::Tensor lengths, int64_t block_size) const {
    const int64_t rows = x.size(0);
    auto h = add_rms_norm(x, delta, norm1_, eps1_);
    auto qkv = qkv_(h);
    auto qk = rotary(qkv, cos, sin, heads_, kv_heads_);
    auto v = qkv.narrow(1, qkv.size(1) - kv_heads_ * dim_, kv_heads_ * dim_)
                 .view({rows, kv_heads_, dim_});
    if (new_blocks) {
      const int64_t blocks = kpool.size(0) / block_size;
      kpool.view({blocks, -1}).index_fill_(0, *new_blocks, 0);
      vpool.view({blocks, -1}).index_fill_(0, *new_blocks, 0);
    }
    kpool.index_copy_(0, slots, qk[1].to(kpool.scalar_type()));
    vpool.index_copy_(0, slots, v.to(vpool.scalar_type()));
    auto out = torch::empty({rows, heads_, dim_}, qk[0].options());
    decode_attention(qk[0], kpool, vpool, tables, lengths, block_size, scale_, out);
    h = add_rms_norm(x, o_(out.view({rows, -1})), norm2_, eps2_);
    return down_(silu_mul(gate_up_(h)));
  }

 private:
  torch::Tensor norm1_, norm2_;
  double eps1_, eps2_;
  Linear qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, dim_;
  double scale_;
};

}  // namespace

void bind_decode_layer(pybind11::module& m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer",
                                "one decoder layer of a small decode step in one call")
      .def(pybind11::init<torch::Tensor, double, torch::Tensor, double, Weights, Weights,
                          Weights, Weights, bool, int64_t, int64_t, int64_t, double>())
      .def("__call__", &DecodeLayer::forward);
}
