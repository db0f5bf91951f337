// pacer: one CLI for vetting nodes, checkpointing, data, telemetry, runs, comm and planning.
#include <fmt/format.h>

#include <cstdio>
#include <map>
#include <string>

#include "commands.hpp"
#include "pacer/core/error.hpp"
#include "pacer/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"pacer: keep large training runs on shared clusters fast and alive"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("pacer ") + pacer::kVersion);
  std::map<CLI::App*, pacer::cli::Handler> handlers;
  auto add = [&](pacer::cli::Handler h) { handlers[app.get_subcommands({}).back()] = std::move(h); };
  add(pacer::cli::register_vet(app));
  add(pacer::cli::register_ckpt(app));
  add(pacer::cli::register_shard(app));
  add(pacer::cli::register_plan(app));
  add(pacer::cli::register_comm(app));
  add(pacer::cli::register_monitor(app));
  add(pacer::cli::register_query(app));
  add(pacer::cli::register_catalog(app));
  add(pacer::cli::register_run(app));
  add(pacer::cli::register_run_agent(app));
  add(pacer::cli::register_ports(app));
  add(pacer::cli::register_bcast(app));
  add(pacer::cli::register_score(app));
  add(pacer::cli::register_report(app));
  add(pacer::cli::register_goodput(app));
  add(pacer::cli::register_annotate(app));
  add(pacer::cli::register_curate(app));
  add(pacer::cli::register_data(app));

  // CLI11 answers `pacer bogus --help` with the root help and exit 0, as
  // --help wins over everything: a script would take a typo for success.
  // The first word names a subcommand (the root has no options that take a
  // value), and the next one a subcommand of it where it has some.
  CLI::App* level = &app;
  for (int i = 1; i < argc && i <= 2; ++i) {
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-' || level->get_subcommands({}).empty()) break;
    CLI::App* next = nullptr;
    for (CLI::App* sub : level->get_subcommands({}))
      if (sub->check_name(word)) next = sub;
    if (!next) {
      const std::string parent = level == &app ? "pacer" : "pacer " + level->get_name();
      std::fprintf(stderr, "pacer: error: unknown command '%s' (%s --help lists them)\n", word.c_str(), parent.c_str());
      return static_cast<int>(pacer::ExitCode::kUsage);
    }
    level = next;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0 in CLI11.
    const int rc = app.exit(e);
    return rc == 0 ? 0 : static_cast<int>(pacer::ExitCode::kUsage);
  }
  try {
    for (auto& [sub, handler] : handlers)
      if (sub->parsed()) return handler();
    return static_cast<int>(pacer::ExitCode::kUsage);
  } catch (const pacer::Exception& e) {
    std::fprintf(stderr, "pacer: error: %s\n", e.what());
    return static_cast<int>(pacer::exit_code_for(e.error().kind));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pacer: internal error: %s\n", e.what());
    return static_cast<int>(pacer::ExitCode::kRuntime);
  }
}
