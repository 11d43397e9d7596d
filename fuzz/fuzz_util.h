// Shared by the tokenizer fuzz targets: the loaders read files, so each input is written into a
// private directory (on /dev/shm where it exists: no disk I/O per execution).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace moat_fuzz {

inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const char* shm = "/dev/shm";
    std::filesystem::path root = std::filesystem::exists(shm) ? shm : std::filesystem::temp_directory_path();
    auto d = root / ("moat_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] { std::error_code ec; std::filesystem::remove_all(scratch_dir(), ec); });
    return d;
  }();
  return dir;
}

inline void write_file(const std::string& name, std::string_view bytes) {
  std::ofstream out(scratch_dir() / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline void remove_file(const std::string& name) {
  std::error_code ec;
  std::filesystem::remove(scratch_dir() / name, ec);
}

// "<main file>\0<tokenizer_config.json>": the part after the first NUL (which neither JSON nor a
// rank file may hold) becomes tokenizer_config.json; without a NUL there is none.
inline void write_with_config(const std::string& main_name, std::string_view input) {
  const size_t nul = input.find('\0');
  write_file(main_name, input.substr(0, nul));
  if (nul == std::string_view::npos) {
    remove_file("tokenizer_config.json");
  } else {
    write_file("tokenizer_config.json", input.substr(nul + 1));
  }
}

}  // namespace moat_fuzz
