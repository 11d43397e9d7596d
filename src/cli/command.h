// Each `moat <command>` lives in its own src/cli/<command>.cpp and registers itself here, so
// adding a command never touches main.cpp:
//   static moat::cli::CommandRegistrar reg("plan", "Will the model fit, and at what cost", setup);
// setup adds options to the subcommand and sets its callback; the callback's return value is the
// process exit code.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace moat::cli {

using CommandSetup = std::function<void(CLI::App& sub, int& exit_code)>;

struct Command {
  std::string name;
  std::string description;
  CommandSetup setup;
};

std::vector<Command>& commands();

struct CommandRegistrar {
  CommandRegistrar(std::string name, std::string description, CommandSetup setup) {
    commands().push_back({std::move(name), std::move(description), std::move(setup)});
  }
};

// Directory of the shipped default model (models/k3-nano), found next to the binary's source
// tree or under $MOAT_HOME; used when a command gets no --model.
std::string default_model_dir();

}  // namespace moat::cli
