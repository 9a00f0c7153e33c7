// Argument checks of the _cpu extension (cpu_kernels.cpp, cpu_forward.cpp). They raise Python's
// ValueError through pybind11, with the message formatted here. They do not go through
// TORCH_CHECK: on one toolchain (gcc 13.3, torch 2.11+cu130) a failed TORCH_CHECK whose message
// formats integers killed the interpreter instead of raising, and keeping the error path inside
// this library leaves it nothing to disagree with torch about.
#pragma once
#include <pybind11/pybind11.h>

#include <sstream>

namespace se_errors {

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw pybind11::value_error(os.str());
}

}  // namespace se_errors

#define SE_CHECK(cond, ...)                       \
  do {                                            \
    if (!(cond)) se_errors::fail(__VA_ARGS__);    \
  } while (0)
