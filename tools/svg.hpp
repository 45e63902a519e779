#pragma once
// A minimal SVG writer for the CLI's figures (explain traces, mask maps, benchmark plots).
// Coordinates are in pixels; text is escaped.

#include <cstdio>
#include <sstream>
#include <string>

namespace flashref::cli {

class svg {
 public:
  svg(double width, double height) : w_(width), h_(height) {}

  void rect(double x, double y, double w, double h, const std::string& fill,
            const std::string& extra = "") {
    os_ << "<rect x='" << x << "' y='" << y << "' width='" << w << "' height='" << h << "' fill='"
        << fill << "' " << extra << "/>\n";
  }
  void line(double x1, double y1, double x2, double y2, const std::string& stroke, double width = 1,
            const std::string& extra = "") {
    os_ << "<line x1='" << x1 << "' y1='" << y1 << "' x2='" << x2 << "' y2='" << y2 << "' stroke='"
        << stroke << "' stroke-width='" << width << "' " << extra << "/>\n";
  }
  void circle(double cx, double cy, double r, const std::string& fill) {
    os_ << "<circle cx='" << cx << "' cy='" << cy << "' r='" << r << "' fill='" << fill << "'/>\n";
  }
  void polyline(const std::string& points, const std::string& stroke, double width = 2) {
    os_ << "<polyline points='" << points << "' fill='none' stroke='" << stroke
        << "' stroke-width='" << width << "'/>\n";
  }
  void text(double x, double y, const std::string& s, double size = 12,
            const std::string& anchor = "start", const std::string& fill = "#222") {
    os_ << "<text x='" << x << "' y='" << y << "' font-size='" << size
        << "' font-family='sans-serif' text-anchor='" << anchor << "' fill='" << fill << "'>"
        << escape(s) << "</text>\n";
  }

  std::string str() const {
    std::ostringstream out;
    out << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w_ << "' height='" << h_
        << "' viewBox='0 0 " << w_ << ' ' << h_ << "'>\n"
        << "<rect width='100%' height='100%' fill='white'/>\n"
        << os_.str() << "</svg>\n";
    return out.str();
  }

  static std::string escape(const std::string& s) {
    std::string r;
    for (char c : s) {
      switch (c) {
        case '<':
          r += "&lt;";
          break;
        case '>':
          r += "&gt;";
          break;
        case '&':
          r += "&amp;";
          break;
        case '\'':
          r += "&apos;";
          break;
        default:
          r += c;
      }
    }
    return r;
  }

 private:
  double w_, h_;
  std::ostringstream os_;
};

}  // namespace flashref::cli
