// The CPU kernels' entry points, as the bindings (cpu_kernels.cpp) and a whole decode layer
// (decode_layer.cpp) call them; defined in decode_attention.cpp, layer_ops.cpp and
// quant_linear.cpp.
// (worker/model/transformers/cpu_kernels.py hashes this header into the build flags, as
// simd.h.)
#pragma once

#include <torch/extension.h>
#include <optional>
#include <vector>

void decode_attention(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool,
                      torch::Tensor tables, torch::Tensor lengths, int64_t block_size,
                      double scale, torch::Tensor out);
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> delta,
                           torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                  int64_t heads, int64_t kv_heads);
bool wide_ops(std::optional<bool> on);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                          std::optional<torch::Tensor> bias);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale_min,
                          std::optional<torch::Tensor> bias);
void bind_decode_layer(pybind11::module& m);
