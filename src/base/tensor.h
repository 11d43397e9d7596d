// The one tensor view type: a pointer, a dtype and a row-major shape. It never owns memory;
// weights point into the mmapped checkpoint, activations into preallocated Buffers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/dtype.h"

namespace moat {

struct Shape {
  static constexpr int kMaxDims = 4;
  std::array<int64_t, kMaxDims> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> list) {
    MOAT_CHECK(list.size() <= kMaxDims, "rank {} > {}", list.size(), kMaxDims);
    for (int64_t d : list) dims[rank++] = d;
  }
  static Shape from(const std::vector<int64_t>& v) {
    Shape s;
    MOAT_CHECK(v.size() <= kMaxDims, "rank {} > {}", v.size(), kMaxDims);
    for (int64_t d : v) s.dims[s.rank++] = d;
    return s;
  }
  int64_t operator[](int i) const { return dims[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
  bool operator==(const Shape& o) const {
    if (rank != o.rank) return false;
    for (int i = 0; i < rank; ++i)
      if (dims[i] != o.dims[i]) return false;
    return true;
  }
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
    return s + "]";
  }
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  template <class T>
  T* as() const { return static_cast<T*>(data); }
  float* f32() const {
    MOAT_CHECK(dtype == DType::F32, "expected F32, got {}", dtype_name(dtype));
    return static_cast<float*>(data);
  }
};

// An owned, 64-byte aligned fp32 buffer for activations and scratch. Allocated once per engine
// (never inside the token loop) and viewed with TensorView.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t num_floats) { resize(num_floats); }
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Grows (never shrinks) and zero-fills the new storage.
  void resize(size_t num_floats);
  float* data() { return data_; }
  const float* data() const { return data_; }
  size_t size() const { return size_; }
  TensorView view(Shape shape) {
    MOAT_CHECK(static_cast<size_t>(shape.numel()) <= size_, "view {} exceeds buffer of {}",
               shape.str(), size_);
    return TensorView{data_, DType::F32, shape};
  }

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace moat
