// The whole decoder's layer loop in C++ (~8 dispatcher calls per layer instead of ~50
// Python-level torch ops), called with the GIL released, and the Python module.
//
// A matrix is one of: DENSE (fp32 or bf16, at::linear), INT8 / INT4 (torch's weight-only
// CPU kernels, bf16 activations), Q4 / Q8 (qgemm over GGUF blocks, fp32 activations quantized to int16 inside).
// The residual stream is fp32; each norm emits the dtype its next matmul takes.
#include <torch/extension.h>

#include "common.h"
#include "ops.h"

#include <tuple>
#include <vector>

namespace si {
namespace {

enum Fmt : int64_t { DENSE = 0, INT8 = 1, INT4 = 2, Q4 = 3, Q8 = 4 };

struct Mat {
  int64_t fmt = DENSE;
  at::Tensor w, aux, bias;  // aux: int8 scales [N] | int4 scales_and_zeros | qgemm fp16 scales
  int64_t n = 0;

  at::ScalarType in_dtype() const {
    if (fmt == Q4 || fmt == Q8) return at::kFloat;
    return fmt == DENSE ? w.scalar_type() : at::kBFloat16;
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    const auto want = in_dtype();
    const auto xin = x.scalar_type() == want ? x : x.to(want);
    if (fmt == DENSE) y = at::linear(xin, w);
    else if (fmt == Q4 || fmt == Q8) y = qgemm(xin, w, aux, fmt == Q4 ? 4 : 8, n, false);
    else if (fmt == INT8) y = at::_weight_int8pack_mm(xin, w, aux);
    else y = at::_weight_int4pack_mm_for_cpu(xin, w, 32, aux);
    if (bias.defined() && bias.numel()) y.add_(bias);
    return y;
  }
};

struct Layer {
  at::Tensor in_norm, post_norm;
  Mat qkv, o, gu, down;
};

class Model {
 public:
  Model(int64_t hq, int64_t hkv, int64_t hd, double eps, at::Tensor cos, at::Tensor sin)
      : hq_(hq), hkv_(hkv), hd_(hd), eps_(eps), cos_(cos.contiguous()), sin_(sin.contiguous()),
        scale_(1.0 / std::sqrt(static_cast<double>(hd))) {}

  // A matrix as (format, n, weight, aux, bias); an empty aux or bias means none.
  using MatSpec = std::tuple<int64_t, int64_t, at::Tensor, at::Tensor, at::Tensor>;

  // mats: qkv, o, gate_up, down
  void add_layer(at::Tensor in_norm, at::Tensor post_norm, const std::vector<MatSpec>& mats) {
    TORCH_CHECK(mats.size() == 4, "add_layer: four matrices (qkv, o, gate_up, down)");
    layers_.push_back({in_norm.contiguous(), post_norm.contiguous(), mat(mats[0]), mat(mats[1]),
                       mat(mats[2]), mat(mats[3])});
  }

  void set_head(at::Tensor norm, const MatSpec& head) {
    norm_ = norm.contiguous();
    head_ = mat(head);
  }

  // x: fp32 [T, D] embeddings (consumed). Every query row listed in paged_idx attends
  // through the pool; fresh: flat (start, len) pairs of fresh prompt chunks attended with
  // SDPA on their own K/V. Returns fp32 logits [S, V] of rows logits_index.
  at::Tensor forward(at::Tensor x, const at::Tensor& pos, const at::Tensor& slot_blocks,
                     const at::Tensor& slot_offsets, at::Tensor kv, const at::Tensor& tables,
                     const at::Tensor& qrow, const at::Tensor& ctx, const at::Tensor& paged_idx,
                     const std::vector<int64_t>& fresh, const at::Tensor& logits_index) {
    c10::InferenceMode guard;
    TORCH_CHECK(!layers_.empty() && head_.w.defined(), "Model: no layers or no head");
    const int64_t T = x.size(0);
    at::Tensor delta;  // the last sublayer's output, added into x by the next norm
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      auto h = add_rms_norm(x, delta.defined() ? std::optional<at::Tensor>(delta) : std::nullopt,
                            L.in_norm, eps_, L.qkv.in_dtype());
      auto qkv = L.qkv(h);  // [T, (hq + 2 hkv) hd]
      rope_kv_write(qkv, cos_, sin_, pos, kv, static_cast<int64_t>(li), slot_blocks, slot_offsets,
                    hq_);
      auto q = qkv.narrow(1, 0, hq_ * hd_);
      auto attn = at::empty({T, hq_ * hd_}, qkv.options());
      paged_attention(q, attn, kv, static_cast<int64_t>(li), tables, qrow, ctx, paged_idx, hq_,
                      scale_);
      for (size_t i = 0; i + 1 < fresh.size(); i += 2) attend_fresh(qkv, attn, fresh[i], fresh[i + 1]);
      auto ao = L.o(attn);
      h = add_rms_norm(x, ao, L.post_norm, eps_, L.gu.in_dtype());
      delta = L.down(silu_mul(L.gu(h)));
    }
    // only the sampled rows need the last residual add, the norm and the head
    auto xs = x.index_select(0, logits_index);
    auto ds = delta.index_select(0, logits_index);
    auto hs = add_rms_norm(xs, ds, norm_, eps_, head_.in_dtype());
    return head_(hs).to(at::kFloat);
  }

 private:
  static Mat mat(const MatSpec& spec) {
    const auto& [fmt, n, w, aux, bias] = spec;
    TORCH_CHECK(fmt >= DENSE && fmt <= Q8, "unknown matrix format");
    Mat m;
    m.fmt = fmt;
    m.n = n;
    m.w = w.contiguous();
    if (aux.numel()) m.aux = aux.contiguous();
    if (bias.numel()) m.bias = bias.contiguous();
    return m;
  }

  void attend_fresh(const at::Tensor& qkv, at::Tensor& attn, int64_t s, int64_t n) const {
    // seg rows [s, s + n): [n, (hq + 2 hkv) hd] -> q [1, hq, n, hd], k/v [1, hkv, n, hd]
    auto seg = qkv.narrow(0, s, n);
    auto qq = seg.narrow(1, 0, hq_ * hd_).view({n, hq_, hd_}).transpose(0, 1).unsqueeze(0);
    auto kk = seg.narrow(1, hq_ * hd_, hkv_ * hd_).view({n, hkv_, hd_}).transpose(0, 1).unsqueeze(0);
    auto vv = seg.narrow(1, (hq_ + hkv_) * hd_, hkv_ * hd_).view({n, hkv_, hd_}).transpose(0, 1).unsqueeze(0);
    auto o = at::scaled_dot_product_attention(qq, kk, vv, std::nullopt, 0.0, true, scale_, true);
    attn.narrow(0, s, n).copy_(o[0].transpose(0, 1).reshape({n, hq_ * hd_}));
  }

  int64_t hq_, hkv_, hd_;
  double eps_;
  at::Tensor cos_, sin_, norm_;
  double scale_;
  std::vector<Layer> layers_;
  Mat head_;
};

void set_grains(int64_t elementwise, int64_t attention, int64_t qgemm) {
  auto& g = grains();
  if (elementwise > 0) g.elementwise = elementwise;
  if (attention > 0) g.attention = attention;
  if (qgemm > 0) g.qgemm = qgemm;
}

}  // namespace
}  // namespace si

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace si;
  m.def("add_rms_norm", &add_rms_norm, "x += delta; rmsnorm(x) * w", py::arg("x"),
        py::arg("delta"), py::arg("w"), py::arg("eps"), py::arg("out_dtype"));
  m.def("rope_kv_write", &rope_kv_write, "RoPE q/k in place and write k/v into the pool");
  m.def("paged_attention", &paged_attention, "attention over the paged pool, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("qgemm", &qgemm, "x @ W^T over GGUF-style packed blocks (int16 activations)", py::arg("x"),
        py::arg("w"), py::arg("sc"), py::arg("bits"), py::arg("n"), py::arg("reference") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("qgemm_isa", &qgemm_isa, "qgemm's SIMD path: avx512-vnni, avx512, avx2-vnni, avx2 or scalar");
  m.def("set_grains", &set_grains, "work per thread before a kernel forks (<= 0: unchanged)",
        py::arg("elementwise") = 0, py::arg("attention") = 0, py::arg("qgemm") = 0);
  py::class_<Model>(m, "Model")
      .def(py::init<int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor>())
      .def("add_layer", &Model::add_layer)
      .def("set_head", &Model::set_head)
      .def("forward", &Model::forward, py::call_guard<py::gil_scoped_release>());
}
