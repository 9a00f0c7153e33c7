// Python bindings of the n-gram draft model (staged_engine._ngram).
//
// Hot calls (topk, propose) read the context straight from a Python list / tuple / sequence
// (only its last order-1 items) and return Python lists built with the C API: no numpy, no
// per-call allocation beyond the result. The GIL is held during queries and updates (the model
// is then never touched by two threads at once) and released while building or parsing.
#include <pybind11/pybind11.h>

#include <Python.h>

#include "ngram.h"

namespace py = pybind11;
using ngram::ArgError;
using ngram::FormatError;
using ngram::Model;

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _ngram
#endif

namespace {

// Convert one Python integer-like item; `what` names the argument in error messages.
int64_t as_int(PyObject* item, const char* what) {
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw ArgError(std::string(what) + ": items must be integers");
  }
  if (overflow != 0) throw ArgError(std::string(what) + ": integer out of range");
  return v;
}

// Read up to `want` trailing items of a sequence of token ids into out (oldest first); checks
// each against the vocabulary. Returns how many were read.
int read_tail(py::handle obj, int want, uint32_t vocab, uint32_t* out, const char* what) {
  PyObject* o = obj.ptr();
  Py_ssize_t n;
  const bool fast = PyList_Check(o) || PyTuple_Check(o);
  if (fast) {
    n = PyList_Check(o) ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
  } else {
    if (!PySequence_Check(o) || PyUnicode_Check(o))
      throw ArgError(std::string(what) + ": must be a sequence of token ids");
    n = PySequence_Size(o);
    if (n < 0) {
      PyErr_Clear();
      throw ArgError(std::string(what) + ": must be a sequence of token ids");
    }
  }
  const int len = static_cast<int>(std::min<Py_ssize_t>(n, want));
  for (int i = 0; i < len; ++i) {
    const Py_ssize_t j = n - len + i;
    int64_t v;
    if (fast) {
      v = as_int(PyList_Check(o) ? PyList_GET_ITEM(o, j) : PyTuple_GET_ITEM(o, j), what);
    } else {
      PyObject* item = PySequence_GetItem(o, j);
      if (item == nullptr) {
        PyErr_Clear();
        throw ArgError(std::string(what) + ": could not read item " + std::to_string(j));
      }
      try {
        v = as_int(item, what);
      } catch (...) {
        Py_DECREF(item);
        throw;
      }
      Py_DECREF(item);
    }
    if (v < 0 || v >= static_cast<int64_t>(vocab))
      throw ArgError(std::string(what) + ": token id " + std::to_string(v) + " is outside [0, " +
                     std::to_string(vocab) + ")");
    out[i] = static_cast<uint32_t>(v);
  }
  return len;
}

template <typename T>
py::list to_list(const std::vector<T>& v) {
  const size_t n = v.size();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
  if (list == nullptr) throw py::error_already_set();
  for (size_t i = 0; i < n; ++i) {
    PyObject* x = PyLong_FromLongLong(static_cast<long long>(v[i]));
    if (x == nullptr) {
      Py_DECREF(list);
      throw py::error_already_set();
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), x);
  }
  return py::reinterpret_steal<py::list>(list);
}

// A C-contiguous one-dimensional int64 buffer (array.array('q'), numpy int64, ...).
struct I64View {
  const int64_t* p;
  size_t n;
};

I64View int64_view(const py::buffer_info& info, const char* what) {
  const bool i64 = info.itemsize == 8 && (info.format == "q" || info.format == "l" ||
                                          info.format == "<q" || info.format == "<l" ||
                                          info.format == "=q" || info.format == "=l");
  if (!i64 || info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != 8))
    throw ArgError(std::string(what) + ": expected a contiguous 1-D int64 buffer");
  return I64View{static_cast<const int64_t*>(info.ptr), static_cast<size_t>(info.shape[0])};
}

// Python-facing wrapper around ngram::Model.
class PyModel {
 public:
  explicit PyModel(std::unique_ptr<Model> m) : m_(std::move(m)) {}

  static PyModel build(py::buffer tokens, py::buffer doc_offsets, int order, int64_t vocab,
                       int64_t top_m, int64_t min_count) {
    if (order < 1 || order > ngram::kMaxOrder)
      throw ArgError("order: must be in 1..4, got " + std::to_string(order));
    if (vocab < 0 || vocab > static_cast<int64_t>(ngram::kMaxVocab))
      throw ArgError("vocab_size: must be in 1..2097152 (2^21), got " + std::to_string(vocab));
    if (top_m < 0) throw ArgError("top_m: must be >= 1 (0 = no cut)");
    if (min_count < 1) throw ArgError("min_count: must be >= 1, got " + std::to_string(min_count));
    py::buffer_info ti = tokens.request(), oi = doc_offsets.request();
    const I64View t = int64_view(ti, "token_ids"), o = int64_view(oi, "doc_offsets");
    std::unique_ptr<Model> m;
    {
      py::gil_scoped_release nogil;
      if (vocab == 0) {  // infer max id + 1; out-of-range ids are reported by the build's check
        if (t.n == 0) throw ArgError("token_ids: empty, so vocab_size cannot be inferred; pass it");
        int64_t lo = 0, hi = 0;
        for (size_t i = 0; i < t.n; ++i) {
          lo = std::min(lo, t.p[i]);
          hi = std::max(hi, t.p[i]);
        }
        vocab = (lo < 0 || hi >= static_cast<int64_t>(ngram::kMaxVocab)) ? ngram::kMaxVocab : hi + 1;
      }
      m = Model::build(t.p, t.n, o.p, o.n, order, static_cast<uint32_t>(vocab),
                       static_cast<uint64_t>(top_m), static_cast<uint64_t>(min_count));
    }
    return PyModel(std::move(m));
  }

  static PyModel from_bytes(py::buffer data) {
    py::buffer_info info = data.request();
    if (info.ndim != 1 || info.itemsize != 1 || (info.shape[0] > 1 && info.strides[0] != 1))
      throw ArgError("data: expected a contiguous bytes-like object");
    std::unique_ptr<Model> m;
    {
      py::gil_scoped_release nogil;
      m = Model::from_bytes(static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size));
    }
    return PyModel(std::move(m));
  }

  py::list topk(py::handle context, int64_t k) const {
    if (k < 1) throw ArgError("k: must be >= 1, got " + std::to_string(k));
    uint32_t ctx[ngram::kMaxOrder];
    const int cl = read_tail(context, m_->order() - 1, m_->vocab_size(), ctx, "context");
    std::vector<uint32_t> out;  // a local: building the list may run Python code (GC)
    m_->topk_into(ctx, cl, static_cast<size_t>(k), out);
    return to_list(out);
  }

  py::tuple propose(py::handle context, py::handle widths) const {
    uint32_t ctx[ngram::kMaxOrder];
    const int cl = read_tail(context, m_->order() - 1, m_->vocab_size(), ctx, "context");
    PyObject* w = widths.ptr();
    if (!PySequence_Check(w) || PyUnicode_Check(w))
      throw ArgError("widths: must be a sequence of positive integers");
    py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(w, "widths"));
    if (!fast) {
      PyErr_Clear();
      throw ArgError("widths: must be a sequence of positive integers");
    }
    const Py_ssize_t nw = PySequence_Fast_GET_SIZE(fast.ptr());
    PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
    std::vector<uint64_t> ws(static_cast<size_t>(nw));
    for (Py_ssize_t j = 0; j < nw; ++j) {
      const int64_t v = as_int(items[j], "widths");
      if (v < 1) throw ArgError("widths: every width must be >= 1, got " + std::to_string(v));
      ws[j] = static_cast<uint64_t>(v);
    }
    std::vector<uint32_t> tok;
    std::vector<int32_t> par;
    m_->propose(ctx, cl, ws.data(), ws.size(), tok, par);
    return py::make_tuple(to_list(tok), to_list(par));
  }

  void update(py::buffer tokens, int64_t skip) {
    py::buffer_info info = tokens.request();
    const I64View t = int64_view(info, "tokens");
    if (skip < 0) throw ArgError("skip: must be >= 0");
    m_->update(t.p, t.n, static_cast<size_t>(skip));
  }

  // The stored ranked list of exactly this context (length <= order-1): [(token, count), ...].
  py::list continuations(py::handle context) const {
    uint32_t ctx[ngram::kMaxOrder + 1];
    const Py_ssize_t n = PyObject_Length(context.ptr());
    if (n < 0) {
      PyErr_Clear();
      throw ArgError("context: must be a sequence of token ids");
    }
    if (n > m_->order() - 1)
      throw ArgError("context: at most order-1 = " + std::to_string(m_->order() - 1) + " ids");
    const int cl = read_tail(context, m_->order() - 1, m_->vocab_size(), ctx, "context");
    const ngram::Span s = m_->lookup(cl, ngram::pack_context(ctx, cl));
    py::list out(s.n);
    for (size_t i = 0; i < s.n; ++i) out[i] = py::make_tuple(s.p[i].token, s.p[i].count);
    return out;
  }

  py::bytes to_bytes() const {
    std::vector<uint8_t> b = m_->to_bytes();
    return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
  }

  const Model& model() const { return *m_; }
  Model& model() { return *m_; }

 private:
  std::unique_ptr<Model> m_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "Back-off n-gram draft model (C++ core of staged_engine.ngram).";
  mod.attr("MAX_ORDER") = ngram::kMaxOrder;
  mod.attr("MAX_VOCAB") = ngram::kMaxVocab;
  mod.attr("FORMAT_VERSION") = ngram::kFormatVersion;

  py::class_<PyModel>(mod, "Model")
      .def_static("build", &PyModel::build, py::arg("tokens"), py::arg("doc_offsets"),
                  py::arg("order"), py::arg("vocab_size"), py::arg("top_m"), py::arg("min_count"),
                  "Build from a flat int64 token buffer and int64 document offsets (D+1 values, "
                  "0 .. len(tokens)); vocab_size = 0 infers max id + 1; top_m = 0 keeps all.")
      .def_static("from_bytes", &PyModel::from_bytes, py::arg("data"),
                  "Parse a version-1 n-gram file image; ValueError if it is not valid.")
      .def("topk", &PyModel::topk, py::arg("context"), py::arg("k"),
           "Ranked continuations of the last order-1 ids of context (back-off, no repeats).")
      .def("propose", &PyModel::propose, py::arg("context"), py::arg("widths"),
           "Mini-tree proposal: (tokens, parents), parent -1 = child of the context tip.")
      .def("update", &PyModel::update, py::arg("tokens"), py::arg("skip"),
           "Add counts of the n-grams of an int64 buffer that end at index >= skip.")
      .def("continuations", &PyModel::continuations, py::arg("context"),
           "Stored ranked [(token, count)] of exactly this context (no back-off).")
      .def("to_bytes", &PyModel::to_bytes, "Serialise to the version-1 file format.")
      .def("fold", [](PyModel& self) { self.model().fold(); },
           "Fold online updates into the compact arrays (no visible change).")
      .def_property_readonly("order", [](const PyModel& s) { return s.model().order(); })
      .def_property_readonly("vocab_size", [](const PyModel& s) { return s.model().vocab_size(); })
      .def_property_readonly("top_m", [](const PyModel& s) { return s.model().top_m(); })
      .def_property_readonly("min_count", [](const PyModel& s) { return s.model().min_count(); })
      .def("num_contexts", [](const PyModel& s, int L) {
             if (L < 0 || L >= ngram::kMaxOrder) throw ArgError("L: must be in 0..3");
             return s.model().num_contexts(L);
           }, py::arg("L"), "Stored contexts of length L (L = 0: 1 if there are unigrams).")
      .def("num_entries", [](const PyModel& s, int L) {
             if (L < 0 || L >= ngram::kMaxOrder) throw ArgError("L: must be in 0..3");
             return s.model().num_entries(L);
           }, py::arg("L"), "Stored (token, count) entries over contexts of length L.")
      .def_property_readonly("memory_bytes", [](const PyModel& s) { return s.model().memory_bytes(); });
}
