#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_ffi, m) {
  m.doc() = "jaxmx native extension";
  m.attr("has_cuda") = false;
}
