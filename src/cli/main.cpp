#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "cli/command.h"

namespace moat::cli {

std::vector<Command>& commands() {
  static std::vector<Command> list;
  return list;
}

std::string default_model_dir() {
  if (const char* home = std::getenv("MOAT_HOME")) return std::string(home) + "/models/k3-nano";
  return std::string(MOAT_SOURCE_DIR) + "/models/k3-nano";
}

}  // namespace moat::cli

int main(int argc, char** argv) {
  CLI::App app{"moat: inference engine and serving stack for MLA + MoE language models"};
  app.require_subcommand(1);
  int exit_code = 0;
  auto& list = moat::cli::commands();
  std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (auto& command : list) {
    CLI::App* sub = app.add_subcommand(command.name, command.description);
    command.setup(*sub, exit_code);
  }
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
