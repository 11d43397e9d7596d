#include "plan/chart.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <cmath>

namespace moat::plan {

namespace {

struct Rgb {
  double r, g, b;
};
constexpr Rgb kWeights{0.27, 0.45, 0.77}, kKv{0.93, 0.55, 0.17}, kHeadroom{0.70, 0.70, 0.70}, kHbm{0.80, 0.10, 0.10};

// Step of 1, 2 or 5 x 10^k giving about `count` gridlines up to max_value.
double grid_step(double max_value, int count) {
  const double raw = max_value / count;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

void text_centered(cairo_t* cr, double x, double y, const std::string& s) {
  cairo_text_extents_t ext;
  cairo_text_extents(cr, s.c_str(), &ext);
  cairo_move_to(cr, x - ext.width / 2 - ext.x_bearing, y);
  cairo_show_text(cr, s.c_str());
}

void draw(cairo_t* cr, double width, double height, const std::vector<PlanRow>& rows, const std::string& title) {
  const double left = 70, right = 170, top = 50, bottom = 70;
  const double pw = width - left - right, ph = height - top - bottom;
  double ymax = 1;
  for (const auto& r : rows)
    ymax = std::max({ymax, r.hbm_gb_per_gpu, r.weights_gb_per_gpu + r.kv_gb_per_gpu + r.state_gb_per_gpu + r.snapshot_gb_per_gpu +
                            r.headroom_gb_per_gpu});
  const double step = grid_step(ymax * 1.05, 6);
  ymax = std::ceil(ymax * 1.05 / step) * step;
  auto Y = [&](double gb) { return top + ph - gb / ymax * ph; };

  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, 12);
  cairo_set_line_width(cr, 1);
  for (double v = 0; v <= ymax + 1e-9; v += step) {
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, left, Y(v));
    cairo_line_to(cr, left + pw, Y(v));
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    std::string label = fmt::format("{:g}", v);
    cairo_text_extents_t ext;
    cairo_text_extents(cr, label.c_str(), &ext);
    cairo_move_to(cr, left - 8 - ext.width, Y(v) + 4);
    cairo_show_text(cr, label.c_str());
  }
  cairo_save(cr);
  cairo_move_to(cr, 22, top + ph / 2 + 35);
  cairo_rotate(cr, -M_PI / 2);
  cairo_show_text(cr, "GB per GPU");
  cairo_restore(cr);

  const double slot = pw / std::max<size_t>(1, rows.size());
  const double bar = std::min(70.0, slot * 0.6);
  for (size_t i = 0; i < rows.size(); ++i) {
    const PlanRow& r = rows[i];
    const double x = left + slot * i + (slot - bar) / 2;
    double base = 0;
    auto segment = [&](double gb, Rgb c) {
      if (gb <= 0) return;
      cairo_set_source_rgb(cr, c.r, c.g, c.b);
      cairo_rectangle(cr, x, Y(base + gb), bar, Y(base) - Y(base + gb));
      cairo_fill(cr);
      base += gb;
    };
    segment(r.weights_gb_per_gpu, kWeights);
    segment(r.kv_gb_per_gpu + r.state_gb_per_gpu + r.snapshot_gb_per_gpu, kKv);  // hybrids: + states, snapshots
    segment(r.headroom_gb_per_gpu, kHeadroom);
    // This GPU's HBM, wider than the bar so it reads as a limit.
    cairo_set_source_rgb(cr, kHbm.r, kHbm.g, kHbm.b);
    cairo_set_line_width(cr, 2.5);
    cairo_move_to(cr, x - 8, Y(r.hbm_gb_per_gpu));
    cairo_line_to(cr, x + bar + 8, Y(r.hbm_gb_per_gpu));
    cairo_stroke(cr);
    cairo_set_line_width(cr, 1);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    text_centered(cr, x + bar / 2, Y(std::max(base, r.hbm_gb_per_gpu)) - 6, r.fits ? "fits" : "no fit");
    text_centered(cr, x + bar / 2, top + ph + 18, r.hardware_name);
    text_centered(cr, x + bar / 2, top + ph + 34,
                  fmt::format("{} GPU{}, TP{}", r.gpus, r.gpus > 1 ? "s" : "", r.tp));
    text_centered(cr, x + bar / 2, top + ph + 50, fmt::format("{} node{}", r.nodes, r.nodes > 1 ? "s" : ""));
  }
  cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
  cairo_move_to(cr, left, top + ph);
  cairo_line_to(cr, left + pw, top + ph);
  cairo_stroke(cr);

  // Legend.
  const double lx = left + pw + 20;
  double ly = top + 10;
  auto swatch = [&](Rgb c, const char* label, bool line) {
    cairo_set_source_rgb(cr, c.r, c.g, c.b);
    if (line) {
      cairo_set_line_width(cr, 2.5);
      cairo_move_to(cr, lx, ly + 6);
      cairo_line_to(cr, lx + 14, ly + 6);
      cairo_stroke(cr);
      cairo_set_line_width(cr, 1);
    } else {
      cairo_rectangle(cr, lx, ly, 14, 12);
      cairo_fill(cr);
    }
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    cairo_move_to(cr, lx + 20, ly + 11);
    cairo_show_text(cr, label);
    ly += 22;
  };
  swatch(kWeights, "weights", false);
  swatch(kKv, "KV cache at context", false);
  swatch(kHeadroom, "headroom", false);
  swatch(kHbm, "HBM per GPU", true);

  cairo_set_font_size(cr, 15);
  cairo_set_source_rgb(cr, 0, 0, 0);
  text_centered(cr, width / 2, 28, title);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

Status draw_memory_chart(const std::string& path, const std::vector<PlanRow>& rows, const std::string& title) {
  if (rows.empty()) return make_error("--chart {}: nothing to draw", path);
  const double width = std::max(640.0, 260.0 + 110.0 * rows.size()), height = 480;
  if (ends_with(path, ".svg")) {
    cairo_surface_t* surface = cairo_svg_surface_create(path.c_str(), width, height);
    if (cairo_surface_status(surface) != CAIRO_STATUS_SUCCESS) {
      cairo_surface_destroy(surface);
      return make_error("--chart {}: cannot create the SVG file", path);
    }
    cairo_t* cr = cairo_create(surface);
    draw(cr, width, height, rows, title);
    cairo_destroy(cr);
    cairo_surface_finish(surface);
    const cairo_status_t st = cairo_surface_status(surface);
    cairo_surface_destroy(surface);
    if (st != CAIRO_STATUS_SUCCESS) return make_error("--chart {}: {}", path, cairo_status_to_string(st));
    return ok_status();
  }
  if (!ends_with(path, ".png")) return make_error("--chart {}: expected a .png or .svg file name", path);
  cairo_surface_t* surface =
      cairo_image_surface_create(CAIRO_FORMAT_ARGB32, static_cast<int>(width), static_cast<int>(height));
  cairo_t* cr = cairo_create(surface);
  draw(cr, width, height, rows, title);
  cairo_destroy(cr);
  const cairo_status_t st = cairo_surface_write_to_png(surface, path.c_str());
  cairo_surface_destroy(surface);
  if (st != CAIRO_STATUS_SUCCESS) return make_error("--chart {}: {}", path, cairo_status_to_string(st));
  return ok_status();
}

}  // namespace moat::plan
