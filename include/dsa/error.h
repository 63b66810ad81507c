// dsa reports every failure as dsa::Error. The kind decides the Python
// exception: invalid_argument -> ValueError, the others -> RuntimeError.
#pragma once

#include <stdexcept>
#include <string>

namespace dsa {

enum class ErrorKind : int {
  invalid_argument,  // the caller's inputs break the contract (shape, dtype, lengths, ...)
  unsupported,       // valid inputs that the chosen backend cannot run
  internal,          // a bug in dsa
  out_of_memory,     // scratch or a workspace could not be allocated (the message names op and bytes)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace dsa
