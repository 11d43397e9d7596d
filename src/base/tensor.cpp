#include "base/tensor.h"

#include <cstdlib>
#include <cstring>
#include <utility>

namespace moat {

Buffer::~Buffer() { std::free(data_); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void Buffer::resize(size_t num_floats) {
  if (num_floats <= size_) return;
  const size_t bytes = ((num_floats * sizeof(float) + 63) / 64) * 64;
  auto* fresh = static_cast<float*>(std::aligned_alloc(64, bytes));
  MOAT_CHECK(fresh != nullptr, "out of memory allocating {} bytes", bytes);
  std::memset(fresh, 0, bytes);
  if (data_) std::memcpy(fresh, data_, size_ * sizeof(float));
  std::free(data_);
  data_ = fresh;
  size_ = num_floats;
}

}  // namespace moat
