#include "flashref/reference/merge.hpp"

#include <sstream>

#include "flashref/reference/problem.hpp"

namespace flashref {

template <class T>
partial_result<T> merge_partials(const partial_result<T>& a, const partial_result<T>& b) {
  auto shape_str = [](const auto& s) {
    std::ostringstream os;
    os << '[';
    for (std::size_t d = 0; d < s.size(); ++d)
      os << (d ? ", " : "") << s[d];
    os << ']';
    return os.str();
  };
  if (a.o.shape() != b.o.shape())  // the parts must cover the same rows
    throw problem_error("o: expected shape " + shape_str(a.o.shape()) + ", got " +
                        shape_str(b.o.shape()));
  const auto& ls = a.o.shape();
  const std::array<std::size_t, 3> lse_shape{ls[0], ls[1], ls[2]};
  if (a.lse.shape() != lse_shape)  // one LSE per output row
    throw problem_error("lse: expected shape " + shape_str(lse_shape) + ", got " +
                        shape_str(a.lse.shape()));
  if (b.lse.shape() != lse_shape)
    throw problem_error("lse: expected shape " + shape_str(lse_shape) + ", got " +
                        shape_str(b.lse.shape()));

  partial_result<T> r{xt::xtensor<T, 4>::from_shape(a.o.shape()),
                      xt::xtensor<T, 3>::from_shape(lse_shape)};
  const std::int64_t dv = std::int64_t(ls[3]);
  for (std::size_t row = 0; row < r.lse.size(); ++row) {
    r.lse.data()[row] =
        merge_partials(a.o.data() + row * ls[3], a.lse.data()[row], b.o.data() + row * ls[3],
                       b.lse.data()[row], dv, r.o.data() + row * ls[3]);
  }
  return r;
}

template partial_result<float> merge_partials(const partial_result<float>&,
                                              const partial_result<float>&);
template partial_result<double> merge_partials(const partial_result<double>&,
                                               const partial_result<double>&);

}  // namespace flashref
