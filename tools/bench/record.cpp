#include "record.hpp"

#include "../io.hpp"
#include "flashref/reference/problem.hpp"

namespace flashref::cli {

nlohmann::json to_json(const bench_record& r) {
  const bench_point& p = r.point;
  nlohmann::json j = {{"backend", r.backend}, {"mask", p.mask},           {"dtype", p.dtype},
                      {"threads", r.threads}, {"median_s", r.median_s},   {"flops", r.flops},
                      {"gflops", r.gflops},   {"tflops", r.gflops * 1e-3}};
  if (p.mask != "none") {  // not a machine baseline: an attention shape
    j.update({{"B", p.B},
              {"Hq", p.Hq},
              {"Hk", p.Hk},
              {"Lq", p.Lq},
              {"Lk", p.Lk},
              {"D", p.D},
              {"Dv", p.Dv},
              {"density", p.density}});
  }
  if (p.mask == "block_sparse") j["block"] = p.block;
  if (p.mask == "block_sparse" && r.mask_hash != 0) j["mask_hash"] = std::to_string(r.mask_hash);
  if (p.mask == "local_window") j["window"] = p.window;
  if (!r.isa.empty()) j["isa"] = r.isa;
  if (r.peak_fraction > 0) j["peak_fraction"] = r.peak_fraction;
  if (r.vs_naive > 0) j["vs_openblas_naive"] = r.vs_naive;
  if (r.vs_reference > 0) j["vs_reference"] = r.vs_reference;
  if (r.vs_dense > 0) j["time_vs_dense"] = r.vs_dense;
  if (r.gbps > 0) j["gbps"] = r.gbps;
  if (!r.kernel.empty()) j["kernel"] = r.kernel;
  if (r.visible_fraction > 0) j["visible_fraction"] = r.visible_fraction;
  if (r.nan_rows >= 0) j["nan_count"] = r.nan_rows;
  if (r.empty_rows >= 0) j["empty_rows"] = r.empty_rows;
  if (r.empty_rows_bad >= 0) j["empty_rows_bad"] = r.empty_rows_bad;
  if (!r.pass.empty()) j["pass"] = r.pass;
  if (r.host_s > 0) j["host_s"] = r.host_s;
  if (r.back_to_back) j["back_to_back"] = true;
  if (!r.note.empty()) j["note"] = r.note;
  return j;
}

void check_output_path(const std::string& path) {
  if (path.empty()) return;
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty() && !std::filesystem::is_directory(dir))
    throw problem_error(path + ": expected a file in an existing folder, got no folder '" +
                        dir.string() + "'");
}

void write_records(const std::filesystem::path& path, const std::vector<bench_record>& recs) {
  nlohmann::json j = nlohmann::json::array();
  for (const bench_record& r : recs)
    j.push_back(to_json(r));
  write_text_atomically(path, j.dump(1) + "\n");
}

}  // namespace flashref::cli
