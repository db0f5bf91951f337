// Naming the hung rank: the collective a faulthandler dump waits in, and the rules' order.
#include <gtest/gtest.h>

#include <string>

#include "run/hang_naming.hpp"

namespace pacer::run {
namespace {

// As torch 1.13 with gloo printed them on this machine (faulthandler, all_threads).
const std::string kTorch113AllReduce =
    "Current thread 0x00007f9d87ac7040 (most recent call first):\n"
    "  File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line 1541 in all_reduce\n"
    "  File \"/work/tests/run/hang_train.py\", line 88 in train\n"
    "  File \"/work/tests/run/hang_train.py\", line 140 in main\n"
    "  File \"/work/tests/run/hang_train.py\", line 150 in <module>\n";
const std::string kTorch113Barrier =
    "Current thread 0x00007fc8f8a9f040 (most recent call first):\n"
    "  File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line 3152 in barrier\n"
    "  File \"/work/tests/run/hang_train.py\", line 80 in train\n"
    "  File \"/work/tests/run/hang_train.py\", line 150 in <module>\n";
// torch 2.x wraps the public collectives (c10d_logger.py).
const std::string kTorch2AllReduce =
    "Thread 0x00007f0000000001 (most recent call first):\n"
    "  File \"/usr/lib/python3.12/threading.py\", line 359 in wait\n"
    "\n"
    "Current thread 0x00007f0000000002 (most recent call first):\n"
    "  File \"/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py\", line 2806 in all_reduce\n"
    "  File \"/venv/lib/python3.12/site-packages/torch/distributed/c10d_logger.py\", line 81 in wrapper\n"
    "  File \"/job/train.py\", line 40 in step\n"
    "  File \"/job/train.py\", line 60 in <module>\n";
const std::string kCompute =
    "Current thread 0x00007f0000000003 (most recent call first):\n"
    "  File \"/work/tests/run/hang_train.py\", line 30 in stuck_in_compute\n"
    "  File \"/work/tests/run/hang_train.py\", line 78 in train\n"
    "  File \"/work/tests/run/hang_train.py\", line 150 in <module>\n"
    "\n"
    "Thread 0x00007f0000000004 (most recent call first):\n"
    "  File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line 1541 in all_reduce\n"
    "  File \"/work/helper.py\", line 3 in run\n";

Suspect suspect(int rank, std::uint64_t step, double idle, const std::string& stacks, std::string host = "") {
  Suspect s;
  s.rank = rank;
  s.host = std::move(host);
  s.step = step;
  s.idle_s = idle;
  if (!stacks.empty()) s.stacks = stacks;
  return s;
}

TEST(HangNaming, CollectiveWaitReadsTheSignalledThreadsInnermostFrames) {
  auto w = collective_wait(kTorch113AllReduce);
  ASSERT_TRUE(w);
  EXPECT_EQ(w->op, "torch.distributed.all_reduce");
  EXPECT_EQ(w->site, "hang_train.py:88 in train");
  w = collective_wait(kTorch113Barrier);
  ASSERT_TRUE(w);
  EXPECT_EQ(w->op, "torch.distributed.barrier");
  // The first thread listed is the one that took the signal; a wait in
  // another thread (the second block of kCompute) does not count.
  w = collective_wait(kTorch2AllReduce.substr(kTorch2AllReduce.find("Current")));
  ASSERT_TRUE(w);
  EXPECT_EQ(w->op, "torch.distributed.all_reduce");
  EXPECT_EQ(w->site, "train.py:40 in step");
  EXPECT_FALSE(collective_wait(kTorch2AllReduce));  // its first thread is in threading.wait
  EXPECT_FALSE(collective_wait(kCompute));
}

TEST(HangNaming, TheCallTheProgramMadeIsTheOp) {
  const std::string nested =
      "Current thread 0x1 (most recent call first):\n"
      "  File \"/x/torch/distributed/distributed_c10d.py\", line 10 in all_gather\n"
      "  File \"/x/torch/distributed/distributed_c10d.py\", line 20 in all_gather_object\n"
      "  File \"/job/eval.py\", line 7 in gather_metrics\n";
  auto w = collective_wait(nested);
  ASSERT_TRUE(w);
  EXPECT_EQ(w->op, "torch.distributed.all_gather_object");
  EXPECT_EQ(w->site, "eval.py:7 in gather_metrics");
  // A collective deeper in the stack than user code is no wait in it.
  EXPECT_FALSE(collective_wait("Current thread 0x1 (most recent call first):\n"
                               "  File \"/job/train.py\", line 3 in compute\n"
                               "  File \"/x/torch/distributed/distributed_c10d.py\", line 20 in barrier\n"));
  // A frame inside torch.distributed that is no collective (rendezvous code).
  EXPECT_FALSE(collective_wait("Stack (most recent call first):\n"
                               "  File \"/x/torch/distributed/rendezvous.py\", line 5 in _env_rendezvous_handler\n"));
  auto m = collective_wait("  File \"/usr/lib/python3/dist-packages/mpi4py/util/pkl5.py\", line 9 in bcast\n"
                           "  File \"/job/t.py\", line 2 in <module>\n");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->op, "mpi4py.bcast");
}

TEST(HangNaming, MalformedTextsAreNoWait) {
  for (const std::string& t : std::vector<std::string>{"", "\n\n", "Current thread 0x1 (most recent call first):\n", "  File \"", "  File \"a\", line ",
                              "  File \"/torch/distributed/x.py\", line 3", std::string(5000, '('),
                              "  File \"/torch/distributed/d.py\", line 1 in barrier"})
    (void)collective_wait(t);  // no crash
  EXPECT_FALSE(collective_wait("Current thread 0x1 (most recent call first):\n  <no Python frame>\n"));
  // The last line may come without its newline (a truncated text).
  auto w = collective_wait("  File \"/torch/distributed/d.py\", line 1 in barrier");
  ASSERT_TRUE(w);
  EXPECT_EQ(w->site, "");
}

TEST(HangNaming, TheRankNotWaitingInACollectiveIsNamed) {
  // Rank 1 sleeps in its compute; 0, 2 and 3 block in the all_reduce it never
  // joins, a moment later, at the same step: 3 stopped "first" by the clock.
  std::vector<Suspect> s = {suspect(0, 7, 3.00, kTorch113AllReduce), suspect(1, 7, 3.01, kCompute),
                            suspect(2, 7, 3.02, kTorch113AllReduce), suspect(3, 7, 3.05, kTorch113AllReduce)};
  auto n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 1u);
  EXPECT_EQ(n.rule, "stacks");
  EXPECT_EQ(n.reason, "ranks 0,2,3 wait in torch.distributed.all_reduce (hang_train.py:88 in train); rank 1 does not");
  auto j = naming_json(s, n);
  EXPECT_EQ(j["rank"], 1);
  EXPECT_FALSE(j.contains("host"));
  EXPECT_EQ(j["rule"], "stacks");
}

TEST(HangNaming, TheRankInACollectiveTheOthersSkippedIsNamed) {
  std::vector<Suspect> s = {suspect(0, 7, 3.05, kTorch113AllReduce, "n1"), suspect(1, 7, 3.0, kTorch113AllReduce, "n1"),
                            suspect(2, 7, 3.0, kTorch113Barrier, "n2"), suspect(3, 7, 3.0, kTorch113AllReduce, "n2")};
  auto n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 2u);
  EXPECT_EQ(n.rule, "stacks");
  EXPECT_EQ(n.reason,
            "ranks 0,1 on n1,3 on n2 wait in torch.distributed.all_reduce (hang_train.py:88 in train); rank 2 on n2 "
            "waits in torch.distributed.barrier (hang_train.py:80 in train)");
  EXPECT_EQ(naming_json(s, n)["host"], "n2");
  // The same op at another call site is another collective.
  std::string other_site = kTorch113AllReduce;
  other_site.replace(other_site.find("line 88"), 7, "line 95");
  s[2].stacks = other_site;
  n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 2u);
}

TEST(HangNaming, WithoutAMajorityTheOneThatStoppedFirstIsNamed) {
  // Two ranks, two collectives: the stacks cannot tell who is odd.
  std::vector<Suspect> s = {suspect(0, 7, 3.0, kTorch113AllReduce), suspect(1, 7, 3.1, kTorch113Barrier)};
  auto n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 1u);
  EXPECT_EQ(n.rule, "first-stopped");
  EXPECT_NE(n.reason.find("no collective that most of them wait in"), std::string::npos) << n.reason;
  EXPECT_NE(n.reason.find("rank 1 stopped first (3.1 s without a heartbeat)"), std::string::npos) << n.reason;
  // All in the same collective, or none with stacks: the clock, then the lowest rank.
  s = {suspect(0, 7, 3.0, kTorch113AllReduce), suspect(1, 7, 3.0, kTorch113AllReduce)};
  n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 0u);
  EXPECT_EQ(n.rule, "first-stopped");
  EXPECT_NE(n.reason.find("the stacks do not single one out"), std::string::npos) << n.reason;
  s = {suspect(4, 7, 3.0, ""), suspect(2, 7, 3.0, "")};
  n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 1u);
  EXPECT_NE(n.reason.find("gave no stacks"), std::string::npos) << n.reason;
}

TEST(HangNaming, StepsAndTimesComeBeforeStacks) {
  // A lower last step wins over the stacks.
  std::vector<Suspect> s = {suspect(0, 8, 3.0, kCompute), suspect(1, 7, 3.1, kTorch113AllReduce),
                            suspect(2, 8, 3.0, kTorch113AllReduce)};
  auto n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 1u);
  EXPECT_EQ(n.rule, "step");
  EXPECT_EQ(n.reason, "rank 1 stopped at step 7, ranks 0,2 later");
  // A rank the others outlasted by more than the window stopped alone.
  s = {suspect(0, 9, 0.1, kCompute), suspect(1, 7, 3.0, kTorch113AllReduce), suspect(2, 9, 0.05, kCompute)};
  n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 1u);
  EXPECT_EQ(n.rule, "alone");
  EXPECT_NE(n.reason.find("ranks 0,2 heartbeated more than 0.2 s after it"), std::string::npos) << n.reason;
  n = name_hung_rank({suspect(5, 1, 9, "")}, 0.2);
  EXPECT_EQ(n.index, 0u);
  EXPECT_EQ(n.reason, "the only rank watched");
  // Ranks outside the window are not compared, whatever their stacks.
  s = {suspect(0, 7, 1.0, kCompute), suspect(1, 7, 3.0, kTorch113AllReduce), suspect(2, 7, 3.0, kCompute)};
  n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 2u);
  EXPECT_EQ(n.rule, "stacks");
  // A step missing anywhere: no step rule.
  s = {suspect(0, 8, 3.0, kCompute), suspect(1, 7, 3.0, kTorch113AllReduce)};
  s[0].step.reset();
  EXPECT_EQ(name_hung_rank(s, 0.2).index, 0u);
}

TEST(HangNaming, ARankSeenElsewhereGoesBeforeOneWithoutStacksThenTheClock) {
  std::vector<Suspect> s = {suspect(0, 7, 3.0, kTorch113AllReduce), suspect(1, 7, 3.0, kCompute),
                            suspect(2, 7, 3.1, ""), suspect(3, 7, 3.0, kTorch113AllReduce)};
  auto n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 1u);
  EXPECT_EQ(n.rule, "stacks");
  EXPECT_EQ(n.reason,
            "ranks 0,3 wait in torch.distributed.all_reduce (hang_train.py:88 in train); rank 1 does not; rank 2 gave "
            "no stacks");
  // Only silent ones besides the waiting: they are named (a rank that cannot
  // even dump, stuck in the kernel), the one idle longest of them.
  s[1].stacks.reset();
  n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 2u);
  EXPECT_EQ(n.rule, "stacks");
  EXPECT_EQ(n.reason,
            "ranks 0,3 wait in torch.distributed.all_reduce (hang_train.py:88 in train); ranks 1,2 gave no stacks; "
            "rank 2 stopped first (3.1 s without a heartbeat)");
  // Two seen elsewhere: the clock between them.
  s = {suspect(0, 7, 3.0, kTorch113AllReduce), suspect(1, 7, 3.0, kCompute), suspect(2, 7, 3.1, kCompute)};
  n = name_hung_rank(s, 0.2);
  EXPECT_EQ(n.index, 2u);
  EXPECT_EQ(n.rule, "stacks");
}

TEST(HangNaming, ACulpritThatHeartbeatedLastStaysACandidate) {
  EXPECT_DOUBLE_EQ(naming_window(3.0, 0.15), 1.5);
  EXPECT_DOUBLE_EQ(naming_window(0.5, 0.5), 1.0);
  // Ranks 0 and 2 heartbeated and blocked in the all_reduce; rank 1 was
  // descheduled for half a second before its last heartbeat, then hung.
  std::vector<Suspect> s = {suspect(0, 7, 3.0, kTorch113AllReduce), suspect(1, 7, 2.5, kCompute),
                            suspect(2, 7, 3.0, kTorch113AllReduce)};
  auto n = name_hung_rank(s, naming_window(3.0, 0.15));
  EXPECT_EQ(n.index, 1u);
  EXPECT_EQ(n.rule, "stacks");
  EXPECT_EQ(name_hung_rank(s, 0.3).index, 0u);  // a window of two polls would leave it out
}

TEST(HangNaming, AttachStacksMatchesRankAndHostAndRecordsTheWait) {
  std::vector<Suspect> s = {suspect(0, 1, 1, "", "n1"), suspect(0, 1, 1, "", "n2"), suspect(1, 1, 1, "", "n2")};
  nlohmann::json stacks = nlohmann::json::array(
      {{{"rank", 0}, {"host", "n2"}, {"text", kTorch113Barrier}},
       {{"rank", 1}, {"host", "n2"}, {"text", nullptr}, {"note", "no stack file"}},
       {{"rank", "x"}, {"text", kCompute}},
       42,
       {{"rank", 0}, {"host", "n1"}, {"text", kCompute}}});
  attach_stacks(s, stacks);
  EXPECT_EQ(s[0].stacks, kCompute);
  EXPECT_EQ(s[1].stacks, kTorch113Barrier);
  EXPECT_FALSE(s[2].stacks);
  EXPECT_EQ(stacks[0]["collective"]["op"], "torch.distributed.barrier");
  EXPECT_EQ(stacks[0]["collective"]["site"], "hang_train.py:80 in train");
  EXPECT_TRUE(stacks[1]["collective"].is_null());
  EXPECT_TRUE(stacks[4]["collective"].is_null());
  nlohmann::json not_array = {{"a", 1}};
  attach_stacks(s, not_array);  // ignored
}

}  // namespace
}  // namespace pacer::run
