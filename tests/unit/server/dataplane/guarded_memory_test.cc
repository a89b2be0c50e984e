// RunGuarded/CopyGuarded: a shared mapping shrunk by its other owner (ftruncate) faults
// with SIGBUS; the guarded copy reports it instead of killing the process.
#include "server/dataplane/guarded_memory.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

namespace kvcd {
namespace guarded_memory_test {

TEST(GuardedMemoryTest, ATruncatedMappingFailsTheCopyInsteadOfTheProcess) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = 4 * page;
  const int fd = memfd_create("kvcd-guarded-test", 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* m = static_cast<uint8_t*>(p);
  std::memset(m, 0x5a, bytes);
  std::string out(bytes, '\0');
  EXPECT_TRUE(CopyGuarded(out.data(), m, bytes, m, bytes));
  EXPECT_EQ(out, std::string(bytes, '\x5a'));

  // The other side shrinks the object to one page: the tail of the mapping is gone.
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(page)), 0);
  EXPECT_TRUE(CopyGuarded(out.data(), m, page, m, bytes));  // the first page is still there
  EXPECT_FALSE(CopyGuarded(out.data(), m, bytes, m, bytes));
  const std::string in(page, 'x');
  EXPECT_FALSE(CopyGuarded(m + 2 * page, in.data(), page, m, bytes));  // writes fault too
  // Repeated faults on the same thread keep being caught (the signal is not left blocked).
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(CopyGuarded(out.data(), m + 3 * page, 8, m, bytes));

  // Growing it back makes the whole mapping usable again.
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_TRUE(CopyGuarded(out.data(), m, bytes, m, bytes));
  munmap(p, bytes);
  close(fd);
}

}  // namespace guarded_memory_test
}  // namespace kvcd
