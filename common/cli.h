// The command line of every kvcd binary: Abseil flags (ABSL_FLAG in the binary's own source
// files) parsed by absl::ParseCommandLine, with
//   - --help (or -h) listing the binary's own flags, or one command's, each with its default
//     and a one-line description, and never Abseil's internal flags (--helpfull lists those);
//   - --version;
//   - the spelling the scripts and documents use: an Abseil flag's name is a C++ identifier,
//     so a dash in a flag's name reads as an underscore (--metrics-listen is --metrics_listen);
//   - a usage error (unknown flag or command, missing or malformed value, stray argument) as
//     one line on stderr saying what was wrong and which --help to run, exit status 2.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvcd::cli {

struct Command {
  std::string name;                // as typed ("serve"); "" is what runs when no command is given
  std::string synopsis;            // what follows "<program> <name>" on the usage line
  std::string description;         // what it does; its first line is its summary in the list
  std::vector<std::string> flags;  // the flags it reads (Abseil names), in help order
  bool takes_args = false;         // positional arguments after the command
};

struct Program {
  std::string name;                // "kvctl"
  std::string summary;             // one line: what the binary is
  std::vector<std::string> files;  // source files whose ABSL_FLAGs are the binary's (__FILE__)
  // A program without commands: its usage line after the name, and whether it takes
  // positional arguments; its flags are all those defined in `files`.
  std::string synopsis;
  bool takes_args = false;
  // A program with commands: the flags every command reads, and the commands.
  std::vector<std::string> global_flags;
  std::vector<Command> commands;
  std::string notes;  // printed after the flags of the program's help (examples, ...)
};

struct Parsed {
  const Command* command = nullptr;  // null for a program without commands
  std::vector<std::string> args;     // positional arguments (after the command)
  // Each flag set on the command line (Abseil name), with its values in order: a flag given
  // more than once holds the last in Abseil and all of them here (--codec a=x --codec b=y).
  std::map<std::string, std::vector<std::string>> given;
  bool Given(absl::string_view flag) const { return given.count(std::string(flag)) > 0; }
  std::vector<std::string> Values(absl::string_view flag) const {
    auto it = given.find(std::string(flag));
    return it == given.end() ? std::vector<std::string>() : it->second;
  }
};

// Sets the Abseil flags from argv. Prints the help or the version and exits 0 when asked
// to; prints a usage error and exits 2 on one.
Parsed Parse(const Program& program, int argc, char** argv);

// A usage error the program finds itself ("--out is required"): prints one line,
// "<program>[ <command>]: <message>; run '<program>[ <command>] --help'", and returns 2.
int UsageError(const Program& program, const Command* command, absl::string_view message);

// The help text of the program (command null) or of one of its commands.
std::string Help(const Program& program, const Command* command);

}  // namespace kvcd::cli
