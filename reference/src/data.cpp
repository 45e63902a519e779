#include "flashref/reference/data.hpp"

#include <string>

namespace flashref {

namespace {

std::array<std::int64_t, 4> dims_of(const xt::xtensor<float, 4>& x) {
  return {std::int64_t(x.shape(0)), std::int64_t(x.shape(1)), std::int64_t(x.shape(2)),
          std::int64_t(x.shape(3))};
}

// A stored tensor seen as (B, H, L, D) whatever its layout.
template <class T>
strided<T, 4> view(T* data, std::array<std::int64_t, 4> stored, tensor_layout layout) {
  if (layout == tensor_layout::blhd)  // stored (B, L, H, D)
    return from_blhd<T>(data, stored[0], stored[1], stored[2], stored[3]);
  return contiguous<T, 4>(data, stored);
}

// The stored shape of O for the inputs q (stored) and v (stored), in `layout`.
std::array<std::size_t, 4> o_storage(const xt::xtensor<float, 4>& q,
                                     const xt::xtensor<float, 4>& v) {
  return {q.shape(0), q.shape(1), q.shape(2), v.shape(3)};  // same layout as q, Dv last
}

// Views of the inputs and the options; outputs are left null.
attention_problem inputs_of(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                            const xt::xtensor<float, 4>& v, const attention_options& opt,
                            tensor_layout layout) {
  attention_problem p;
  p.q = view<const float>(q.data(), dims_of(q), layout);
  p.k = view<const float>(k.data(), dims_of(k), layout);
  p.v = view<const float>(v.data(), dims_of(v), layout);
  p.o.shape = {p.q.shape[0], p.q.shape[1], p.q.shape[2], p.v.shape[3]};
  p.lse.shape = {p.q.shape[0], p.q.shape[1], p.q.shape[2]};
  p.scale = opt.scale;
  p.causal = opt.causal;
  p.window_left = opt.window_left;
  p.window_right = opt.window_right;
  if (opt.block_mask.size() > 0 || opt.block_q != 0 || opt.block_k != 0) {
    const auto& m = opt.block_mask;
    p.block_mask = contiguous<const std::uint8_t, 4>(
        m.data(), {std::int64_t(m.shape(0)), std::int64_t(m.shape(1)), std::int64_t(m.shape(2)),
                   std::int64_t(m.shape(3))});
    if (p.block_mask.data == nullptr) {
      static const std::uint8_t kNone = 0;  // a zero-sized mask still needs a non-null pointer
      p.block_mask.data = &kNone;
    }
    p.block_q = opt.block_q;
    p.block_k = opt.block_k;
  }
  if (!opt.kv_len.empty()) {
    const std::int64_t B = p.batch();
    if (std::int64_t(opt.kv_len.size()) != B)  // one key length per batch entry
      throw problem_error("kv_len: expected " + std::to_string(B) + " entries, got " +
                          std::to_string(opt.kv_len.size()));
    p.kv_len = opt.kv_len.data();
  }
  p.dtype = opt.dtype;
  return p;
}

// Allocates o and lse for the inputs (when their shapes differ) and points p's outputs at them.
void attach_outputs(attention_problem& p, const std::array<std::size_t, 4>& o_stored,
                    tensor_layout layout, xt::xtensor<float, 4>& o, xt::xtensor<float, 3>& lse) {
  if (std::array<std::size_t, 4>{o.shape(0), o.shape(1), o.shape(2), o.shape(3)} != o_stored)
    o = xt::xtensor<float, 4>::from_shape(o_stored);
  const std::array<std::size_t, 3> lse_shape{std::size_t(p.batch()), std::size_t(p.heads_q()),
                                             std::size_t(p.len_q())};
  if (std::array<std::size_t, 3>{lse.shape(0), lse.shape(1), lse.shape(2)} != lse_shape)
    lse = xt::xtensor<float, 3>::from_shape(lse_shape);
  p.o = view<float>(o.data(), dims_of(o), layout);
  p.lse = contiguous<float, 3>(lse.data(), p.lse.shape);
}

}  // namespace

attention_problem problem_data::problem() {
  attention_problem p = inputs_of(q, k, v, opt, layout);
  attach_outputs(p, o_storage(q, v), layout, o, lse);
  return p;
}

attention_problem problem_data::inputs() const {
  return inputs_of(q, k, v, opt, layout);
}

attention_gradients problem_data::gradients() {
  auto shaped_like = [](xt::xtensor<float, 4>& x, const xt::xtensor<float, 4>& like) {
    if (x.shape() != like.shape()) x = xt::xtensor<float, 4>::from_shape(like.shape());
  };
  shaped_like(dq, q);
  shaped_like(dk, k);
  shaped_like(dv, v);
  attention_gradients g;
  g.d_o = view<const float>(d_o.data(), dims_of(d_o), layout);
  g.dq = view<float>(dq.data(), dims_of(dq), layout);
  g.dk = view<float>(dk.data(), dims_of(dk), layout);
  g.dv = view<float>(dv.data(), dims_of(dv), layout);
  return g;
}

attention_problem make_problem(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                               const xt::xtensor<float, 4>& v, const attention_options& opt,
                               xt::xtensor<float, 4>& o, xt::xtensor<float, 3>& lse) {
  attention_problem p = inputs_of(q, k, v, opt, tensor_layout::bhld);
  attach_outputs(p, o_storage(q, v), tensor_layout::bhld, o, lse);
  return p;
}

}  // namespace flashref
