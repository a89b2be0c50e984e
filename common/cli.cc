#include "common/cli.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace kvcd::cli {
namespace {

std::string Invocation(const Program& program, const Command* command) {
  return command == nullptr || command->name.empty()
             ? program.name
             : absl::StrCat(program.name, " ", command->name);
}

[[noreturn]] void ExitUsage(const Program& program, const Command* command,
                            absl::string_view message) {
  UsageError(program, command, message);
  std::exit(2);
}

// How the flag is spelled in help and errors: with dashes, as the scripts use it.
std::string Spelling(absl::string_view name) {
  return absl::StrCat("--", absl::StrReplaceAll(name, {{"_", "-"}}));
}

std::string DefaultOf(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<std::string>()) return absl::StrCat("\"", flag.DefaultValue(), "\"");
  return flag.DefaultValue();
}

const absl::CommandLineFlag& Find(absl::string_view name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag == nullptr) {
    std::fprintf(stderr, "kvcd::cli: the help names flag '%.*s', which is not defined\n",
                 static_cast<int>(name.size()), name.data());
    std::abort();
  }
  return *flag;
}

void AppendFlags(const std::vector<const absl::CommandLineFlag*>& flags, std::string* out) {
  size_t width = 0;
  for (const auto* f : flags) width = std::max(width, Spelling(f->Name()).size());
  width = std::min<size_t>(width, 24);
  for (const auto* f : flags) {
    const std::string name = Spelling(f->Name());
    absl::StrAppend(out, "  ", name);
    if (name.size() > width) {
      absl::StrAppend(out, "\n", std::string(width + 2, ' '));
    } else {
      absl::StrAppend(out, std::string(width - name.size(), ' '));
    }
    absl::StrAppend(out, "  ", f->Help(), " (default: ", DefaultOf(*f), ")\n");
  }
}

// Whether a flag defined in `file` (CommandLineFlag::Filename(), which Abseil normalizes by
// stripping leading slashes) is one of the program's, whose files are given as __FILE__.
bool InFiles(const Program& program, absl::string_view file) {
  auto strip = [](absl::string_view f) {
    const size_t start = f.find_first_not_of("/\\");
    return start == absl::string_view::npos ? absl::string_view() : f.substr(start);
  };
  for (const auto& f : program.files)
    if (strip(file) == strip(f)) return true;
  return false;
}

std::vector<const absl::CommandLineFlag*> FlagsOfFiles(const Program& program) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags())
    if (InFiles(program, flag->Filename())) flags.push_back(flag);
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  return flags;
}

std::vector<const absl::CommandLineFlag*> Named(const std::vector<std::string>& names) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& n : names) flags.push_back(&Find(n));
  return flags;
}

const Command* FindCommand(const Program& program, absl::string_view name) {
  for (const auto& c : program.commands)
    if (c.name == name) return &c;
  return nullptr;
}

// Usage flags Abseil handles itself (they are not registered as flags).
bool IsAbseilUsageFlag(absl::string_view name) {
  for (const char* f :
       {"helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "only_check_args"})
    if (name == f) return true;
  return false;
}

}  // namespace

int UsageError(const Program& program, const Command* command, absl::string_view message) {
  const std::string who = Invocation(program, command);
  std::fprintf(stderr, "%s: %.*s; run '%s --help'\n", who.c_str(), static_cast<int>(message.size()),
               message.data(), who.c_str());
  return 2;
}

std::string Help(const Program& program, const Command* command) {
  std::string out;
  const bool has_commands = !program.commands.empty();
  if (command == nullptr || command->name.empty()) {
    absl::StrAppend(&out, program.name, " — ", program.summary, "\n\n");
  } else {
    const std::vector<std::string> lines = absl::StrSplit(command->description, '\n');
    absl::StrAppend(&out, Invocation(program, command), " — ", lines[0], "\n\n");
  }
  if (!has_commands) {
    absl::StrAppend(&out, "Usage: ", program.name, " ", program.synopsis, "\n");
    const auto flags = FlagsOfFiles(program);
    if (!flags.empty()) {
      absl::StrAppend(&out, "\nFlags:\n");
      AppendFlags(flags, &out);
    }
  } else if (command == nullptr) {
    absl::StrAppend(&out, "Usage: ", program.name, " COMMAND [flags]\n\nCommands:\n");
    size_t width = 0;
    for (const auto& c : program.commands) width = std::max(width, c.name.size());
    for (const auto& c : program.commands) {
      if (c.name.empty()) continue;
      const std::vector<std::string> lines = absl::StrSplit(c.description, '\n');
      absl::StrAppend(&out, "  ", c.name, std::string(width - c.name.size() + 2, ' '), lines[0],
                      "\n");
    }
    absl::StrAppend(&out, "\nRun '", program.name, " COMMAND --help' for a command's flags.\n");
    if (!program.global_flags.empty()) {
      absl::StrAppend(&out, "\nGlobal flags:\n");
      AppendFlags(Named(program.global_flags), &out);
    }
  } else {
    absl::StrAppend(&out, "Usage: ", Invocation(program, command), " ", command->synopsis, "\n");
    const size_t nl = command->description.find('\n');
    if (nl != std::string::npos) absl::StrAppend(&out, command->description.substr(nl), "\n");
    if (!command->flags.empty()) {
      absl::StrAppend(&out, "\nFlags:\n");
      AppendFlags(Named(command->flags), &out);
    }
    if (!program.global_flags.empty()) {
      absl::StrAppend(&out, "\nGlobal flags:\n");
      AppendFlags(Named(program.global_flags), &out);
    }
    if (command->name.empty()) {
      absl::StrAppend(&out, "\nCommands:\n");
      for (const auto& c : program.commands) {
        if (c.name.empty()) continue;
        const std::vector<std::string> lines = absl::StrSplit(c.description, '\n');
        absl::StrAppend(&out, "  ", c.name, "  ", lines[0], "\n");
      }
    }
  }
  if (!program.notes.empty() && (command == nullptr || command->name.empty())) {
    absl::StrAppend(&out, "\n", program.notes);
    if (out.back() != '\n') out += '\n';
  }
  return out;
}

Parsed Parse(const Program& program, int argc, char** argv) {
  const std::string version = absl::StrCat(program.name, " ", KVCD_VERSION);
  absl::SetProgramUsageMessage(
      absl::StrCat(program.summary, "; run '", program.name, " --help' for its flags"));
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [&program](absl::string_view f) { return InFiles(program, f); };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = [version] { return version + "\n"; };
  absl::SetFlagsUsageConfig(config);

  // Read argv once to find --help, --version, the command and usage errors, and to spell
  // every flag as Abseil's name; then absl::ParseCommandLine sets the flags.
  std::vector<std::string> args = {argv[0]};
  std::vector<std::string> positional;
  std::map<std::string, std::vector<std::string>> given;
  bool help = false, show_version = false, terminated = false;
  std::string error;
  auto fail = [&error](std::string e) {
    if (error.empty()) error = std::move(e);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (terminated || a.size() < 2 || a[0] != '-') {
      positional.push_back(a);
      args.push_back(a);
      continue;
    }
    if (a == "--") {
      terminated = true;
      args.push_back(a);
      continue;
    }
    absl::string_view body = a;
    body.remove_prefix(a[1] == '-' ? 2 : 1);
    const size_t eq = body.find('=');
    const bool has_value = eq != absl::string_view::npos;
    const std::string name = absl::StrReplaceAll(body.substr(0, eq), {{"-", "_"}});
    const std::string value(has_value ? body.substr(eq + 1) : absl::string_view());
    if (name == "h" || name == "help") {
      help = true;
      continue;
    }
    if (name == "version") {
      show_version = true;
      continue;
    }
    if (IsAbseilUsageFlag(name)) {
      args.push_back(has_value ? absl::StrCat("--", name, "=", value) : "--" + name);
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no")) {  // --noinsecure
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>() && !has_value) {
        args.push_back("--" + name);
        given[name.substr(2)].push_back("false");
        continue;
      }
    }
    if (flag == nullptr || flag->IsRetired()) {
      fail(absl::StrCat("unknown flag '--", body.substr(0, eq), "'"));
      continue;
    }
    std::string v = value;
    if (!has_value && !flag->IsOfType<bool>()) {
      if (i + 1 >= argc) {
        fail(absl::StrCat("flag ", Spelling(name), " needs a value"));
        continue;
      }
      v = argv[++i];
    } else if (!has_value) {
      v = "true";
    }
    std::string why;
    if (!flag->ParseFrom(v, &why)) {
      // Abseil's message names the flag with underscores; keep only its reason, if any.
      const size_t reason = why.find("; ");
      fail(absl::StrCat("bad value '", v, "' for ", Spelling(name),
                        reason == std::string::npos ? "" : why.substr(reason)));
      continue;
    }
    args.push_back(absl::StrCat("--", name, "=", v));
    given[name].push_back(v);
  }

  Parsed parsed;
  size_t first_arg = 0;
  std::string command_error;
  if (!program.commands.empty()) {
    if (!positional.empty() && positional[0] == "help") {
      help = true;
      positional.erase(positional.begin());
    }
    parsed.command = positional.empty() ? nullptr : FindCommand(program, positional[0]);
    if (parsed.command != nullptr) {
      first_arg = 1;
    } else {
      parsed.command = FindCommand(program, "");  // what runs without a command, if anything
      if (parsed.command == nullptr) {
        command_error = positional.empty() ? "no command given"
                                           : absl::StrCat("unknown command '", positional[0], "'");
      }
    }
  }
  if (help) {
    std::fputs(Help(program, parsed.command).c_str(), stdout);
    std::exit(0);
  }
  if (show_version) {
    std::printf("%s\n", version.c_str());
    std::exit(0);
  }
  if (!error.empty()) ExitUsage(program, parsed.command, error);
  if (!command_error.empty()) ExitUsage(program, nullptr, command_error);
  const bool takes_args = parsed.command ? parsed.command->takes_args : program.takes_args;
  if (!takes_args && positional.size() > first_arg) {
    ExitUsage(program, parsed.command,
              absl::StrCat("unexpected argument '", positional[first_arg], "'"));
  }

  std::vector<char*> abseil_argv;
  for (auto& a : args) abseil_argv.push_back(a.data());
  abseil_argv.push_back(nullptr);
  absl::ParseCommandLine(static_cast<int>(args.size()), abseil_argv.data());
  parsed.given = std::move(given);
  parsed.args.assign(positional.begin() + static_cast<std::ptrdiff_t>(first_arg), positional.end());
  return parsed;
}

}  // namespace kvcd::cli
