#include "core/validate.h"
#include "dsa/layout.h"

namespace dsa {

Layout parse_layout(std::string_view name) {
  if (name == "TND") return Layout::TND;
  if (name == "BSND") return Layout::BSND;
  core::fail_argument("layout: expected 'TND' or 'BSND', got '", name, "'");
}

const char* layout_name(Layout layout) { return layout == Layout::TND ? "TND" : "BSND"; }

}  // namespace dsa
