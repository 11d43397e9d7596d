// Errors from the outside world (files, requests, flags) are values: Result<T> holds either a T
// or an Error whose message names the file, field or parameter and what was expected.
// Broken invariants inside moat are MOAT_CHECK failures (see check.h), never Results.
#pragma once

#include <fmt/format.h>

#include <string>
#include <utility>
#include <variant>

namespace moat {

struct Error {
  std::string message;
};

template <class... Args>
Error make_error(fmt::format_string<Args...> format, Args&&... args) {
  return Error{fmt::format(format, std::forward<Args>(args)...)};
}

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Error error) : v_(std::move(error)) {}  // NOLINT
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &std::get<0>(v_); }
  const T* operator->() const { return &std::get<0>(v_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  const Error& error() const { return std::get<1>(v_); }
  Error&& take_error() { return std::get<1>(std::move(v_)); }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return error_; }
  Error&& take_error() { return std::move(error_); }

 private:
  Error error_;
  bool ok_ = true;
};

using Status = Result<void>;

inline Status ok_status() { return Status(); }

}  // namespace moat

// Propagates an error: MOAT_TRY(status_expr); or auto x = MOAT_TRY_VALUE(result_expr);
#define MOAT_TRY(expr)                                  \
  do {                                                  \
    auto moat_try_result_ = (expr);                     \
    if (!moat_try_result_.ok()) return moat_try_result_.take_error(); \
  } while (0)

#define MOAT_CONCAT_INNER(a, b) a##b
#define MOAT_CONCAT(a, b) MOAT_CONCAT_INNER(a, b)
#define MOAT_ASSIGN_OR_RETURN(lhs, expr) \
  MOAT_ASSIGN_OR_RETURN_IMPL(MOAT_CONCAT(moat_result_, __LINE__), lhs, expr)
#define MOAT_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.take_error();          \
  lhs = std::move(tmp).value()
