// EnvChoice: the index of the named value, the first name when the variable is unset or
// holds something else.
#include "common/env_choice.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace kvcd {
namespace {

constexpr char kVar[] = "KVCD_ENV_CHOICE_TEST";

TEST(EnvChoiceTest, NamesTheIndexAndFallsBackToTheFirst) {
  unsetenv(kVar);
  EXPECT_EQ(EnvChoice(kVar, {"dependent", "kernel", "fold"}), 0);
  setenv(kVar, "fold", 1);
  EXPECT_EQ(EnvChoice(kVar, {"dependent", "kernel", "fold"}), 2);
  setenv(kVar, "kernel", 1);
  EXPECT_EQ(EnvChoice(kVar, {"dependent", "kernel", "fold"}), 1);
  setenv(kVar, "dependent", 1);
  EXPECT_EQ(EnvChoice(kVar, {"dependent", "kernel", "fold"}), 0);
  for (const char* other : {"", "Fold", "fold ", "folded"}) {
    setenv(kVar, other, 1);
    EXPECT_EQ(EnvChoice(kVar, {"dependent", "kernel", "fold"}), 0) << "'" << other << "'";
  }
  unsetenv(kVar);
}

}  // namespace
}  // namespace kvcd
