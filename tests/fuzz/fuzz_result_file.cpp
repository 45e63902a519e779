// Fuzz harness: bytes as a result file (/o, /lse and the attributes `flashref run` writes, or
// any other kernel's), read from memory the way `flashref check --candidate` reads it: its
// description first, then O and LSE against a golden result of shape [1, 2, 4, 8], and the
// gradients /dq, /dk, /dv where present against golden ones of q [1, 2, 4, 8], k and v
// [1, 1, 6, 8].
#include <cstddef>
#include <cstdint>

#include "flashref/testdata/fixture.hpp"
#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const flashref::reference::golden golden = [] {
    flashref::reference::golden g;
    g.o_shape = {1, 2, 4, 8};
    g.o.assign(64, 0.5);
    g.lse.assign(8, 1.0);
    return g;
  }();
  static const flashref::reference::golden_gradients grads = [] {
    flashref::reference::golden_gradients g;
    g.q_shape = {1, 2, 4, 8};
    g.k_shape = g.v_shape = {1, 1, 6, 8};
    g.dq.assign(64, 0.25);
    g.dk.assign(48, 0.5);
    g.dv.assign(48, -0.5);
    g.row_empty.assign(8, 0);
    g.key_unseen.assign(6, 0);
    return g;
  }();
  flashref::fuzz::expect_refusal_only([&] {
    const auto f = flashref::testdata::h5::file::open_image(data, size, "result.h5");
    const flashref::testdata::result_info info = flashref::testdata::read_result_info(f);
    const flashref::testdata::result r = flashref::testdata::read_result(f, golden, &grads);
    flashref::fuzz::require(r.o.size() == golden.o.size(), "O of the golden shape");
    flashref::fuzz::require(!r.has_lse || r.lse.size() == golden.lse.size(),
                            "LSE of the golden shape");
    flashref::fuzz::require(!r.dq || r.dq->size() == grads.dq.size(), "dQ of the golden shape");
    flashref::fuzz::require(!r.dk || r.dk->size() == grads.dk.size(), "dK of the golden shape");
    flashref::fuzz::require(!r.dv || r.dv->size() == grads.dv.size(), "dV of the golden shape");
    (void)info;
  });
  return 0;
}
