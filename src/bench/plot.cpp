#include "bench/plot.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <cmath>

namespace moat::bench {

std::vector<double> nice_ticks(double max_value, int target_count) {
  if (!(max_value > 0)) max_value = 1;
  double raw = max_value / std::max(1, target_count);
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  std::vector<double> ticks;
  for (int i = 0; i * step <= max_value * (1 + 1e-9) + step; ++i) {
    ticks.push_back(i * step);
    if (i * step >= max_value) break;
  }
  return ticks;
}

namespace {

std::string tick_label(double v) {
  if (v >= 10000) return fmt::format("{:.0f}k", v / 1000);
  if (v == std::floor(v)) return fmt::format("{:.0f}", v);
  return fmt::format("{:g}", v);
}

void draw(cairo_t* cr, double width, double height, const std::vector<Metrics>& sweep, int gpus,
          const std::string& title) {
  const double left = 80, right = 30, top = 50, bottom = 60;
  const double pw = width - left - right, ph = height - top - bottom;
  std::vector<std::pair<double, double>> pts;
  std::vector<std::string> labels;
  for (const Metrics& m : sweep) {
    pts.emplace_back(m.per_stream_tps, m.output_tps / std::max(1, gpus));
    labels.push_back(m.concurrency > 0 ? fmt::format("c={}", m.concurrency) : "c=inf");
  }
  double xmax = 0, ymax = 0;
  for (auto [x, y] : pts) xmax = std::max(xmax, x), ymax = std::max(ymax, y);
  std::vector<double> xt = nice_ticks(xmax * 1.05, 6), yt = nice_ticks(ymax * 1.05, 6);
  xmax = xt.back();
  ymax = yt.back();
  auto X = [&](double x) { return left + x / xmax * pw; };
  auto Y = [&](double y) { return top + ph - y / ymax * ph; };

  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, 12);

  // Grid and ticks.
  cairo_set_line_width(cr, 1);
  cairo_text_extents_t ext;
  for (double t : xt) {
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, X(t), top);
    cairo_line_to(cr, X(t), top + ph);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    std::string s = tick_label(t);
    cairo_text_extents(cr, s.c_str(), &ext);
    cairo_move_to(cr, X(t) - ext.width / 2, top + ph + 18);
    cairo_show_text(cr, s.c_str());
  }
  for (double t : yt) {
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, left, Y(t));
    cairo_line_to(cr, left + pw, Y(t));
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    std::string s = tick_label(t);
    cairo_text_extents(cr, s.c_str(), &ext);
    cairo_move_to(cr, left - 8 - ext.width, Y(t) + ext.height / 2);
    cairo_show_text(cr, s.c_str());
  }
  // Axes.
  cairo_set_source_rgb(cr, 0, 0, 0);
  cairo_set_line_width(cr, 1.5);
  cairo_move_to(cr, left, top);
  cairo_line_to(cr, left, top + ph);
  cairo_line_to(cr, left + pw, top + ph);
  cairo_stroke(cr);
  // Axis labels and title.
  cairo_set_font_size(cr, 14);
  const char* xl = "per-stream decode tok/s (1 / TPOT)";
  cairo_text_extents(cr, xl, &ext);
  cairo_move_to(cr, left + pw / 2 - ext.width / 2, height - 18);
  cairo_show_text(cr, xl);
  std::string yl = gpus > 1 ? "aggregate output tok/s per GPU" : "aggregate output tok/s";
  cairo_text_extents(cr, yl.c_str(), &ext);
  cairo_save(cr);
  cairo_move_to(cr, 22, top + ph / 2 + ext.width / 2);
  cairo_rotate(cr, -M_PI / 2);
  cairo_show_text(cr, yl.c_str());
  cairo_restore(cr);
  cairo_set_font_size(cr, 15);
  cairo_text_extents(cr, title.c_str(), &ext);
  cairo_move_to(cr, left + pw / 2 - ext.width / 2, 28);
  cairo_show_text(cr, title.c_str());

  // The curve in sweep order, then the points and their concurrency labels.
  cairo_set_source_rgb(cr, 0.12, 0.35, 0.75);
  cairo_set_line_width(cr, 2);
  for (size_t i = 0; i < pts.size(); ++i) {
    if (i == 0) cairo_move_to(cr, X(pts[i].first), Y(pts[i].second));
    else cairo_line_to(cr, X(pts[i].first), Y(pts[i].second));
  }
  cairo_stroke(cr);
  cairo_set_font_size(cr, 12);
  for (size_t i = 0; i < pts.size(); ++i) {
    cairo_set_source_rgb(cr, 0.85, 0.3, 0.1);
    cairo_arc(cr, X(pts[i].first), Y(pts[i].second), 4.5, 0, 2 * M_PI);
    cairo_fill(cr);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    cairo_move_to(cr, X(pts[i].first) + 7, Y(pts[i].second) - 7);
    cairo_show_text(cr, labels[i].c_str());
  }
}

}  // namespace

Status plot_throughput_curve(const std::string& path, const std::vector<Metrics>& sweep, int gpus,
                             const std::string& title) {
  if (sweep.empty()) return make_error("--plot {}: nothing measured to plot", path);
  const double w = 800, h = 560;
  auto ends_with = [&](const char* ext) {
    std::string e = ext;
    return path.size() >= e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  bool svg = ends_with(".svg");
  if (!svg && !ends_with(".png"))
    return make_error("--plot {}: expected a file name ending in .png or .svg", path);
  cairo_surface_t* surface = svg ? cairo_svg_surface_create(path.c_str(), w, h)
                                 : cairo_image_surface_create(CAIRO_FORMAT_ARGB32, w, h);
  if (cairo_surface_status(surface) != CAIRO_STATUS_SUCCESS) {
    std::string why = cairo_status_to_string(cairo_surface_status(surface));
    cairo_surface_destroy(surface);
    return make_error("--plot {}: {}", path, why);
  }
  cairo_t* cr = cairo_create(surface);
  draw(cr, w, h, sweep, gpus, title);
  cairo_destroy(cr);
  cairo_status_t st = CAIRO_STATUS_SUCCESS;
  if (svg) {
    cairo_surface_finish(surface);
    st = cairo_surface_status(surface);
  } else {
    st = cairo_surface_write_to_png(surface, path.c_str());
  }
  cairo_surface_destroy(surface);
  if (st != CAIRO_STATUS_SUCCESS)
    return make_error("--plot {}: {}", path, cairo_status_to_string(st));
  return ok_status();
}

}  // namespace moat::bench
