// EnvChoice: which of a fixed list of names an environment variable holds (the daemon's
// KVCD_* switches), the first name being the default.
#pragma once

#include <initializer_list>

namespace kvcd {

// The index in `names` of the value of environment variable `var`; 0 (the first name, the
// default) when it is unset, and when it holds anything else, which is reported (a warning
// naming the accepted values) and ignored.
int EnvChoice(const char* var, std::initializer_list<const char*> names);

}  // namespace kvcd
