#include "common/env_choice.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "common/log.h"

namespace kvcd {

int EnvChoice(const char* var, std::initializer_list<const char*> names) {
  const char* v = std::getenv(var);
  if (v == nullptr) return 0;
  int i = 0;
  std::string listed;
  for (const char* name : names) {
    if (std::strcmp(v, name) == 0) return i;
    listed += (i == 0 ? "" : ", ") + std::string(name);
    ++i;
  }
  KVCD_LOG(WARNING) << var << "=" << v << " is not one of " << listed << "; using "
                    << *names.begin();
  return 0;
}

}  // namespace kvcd
