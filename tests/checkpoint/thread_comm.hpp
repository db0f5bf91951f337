// A communicator of N ranks that are threads of one process, for testing collective code without MPI.
#pragma once

#include <barrier>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pacer/comm/communicator.hpp"

namespace pacer::test {

class ThreadWorld {
 public:
  explicit ThreadWorld(int n) : n_(n), sync_(n), oks_(static_cast<std::size_t>(n), 1) {}

  class Rank final : public comm::Communicator {
   public:
    Rank(ThreadWorld* w, int r) : w_(w), r_(r) {}
    int rank() const override { return r_; }
    int size() const override { return w_->n_; }
    void barrier() override { w_->sync_.arrive_and_wait(); }
    bool all_ok(bool ok) override {
      w_->oks_[static_cast<std::size_t>(r_)] = ok ? 1 : 0;
      w_->sync_.arrive_and_wait();
      bool all = true;
      for (int v : w_->oks_) all = all && v;
      w_->sync_.arrive_and_wait();  // nobody overwrites oks_ before all have read it
      return all;
    }
    std::string broadcast(const std::string& value, int root) override {
      if (r_ == root) w_->shared_ = value;
      w_->sync_.arrive_and_wait();
      std::string out = w_->shared_;
      w_->sync_.arrive_and_wait();
      return out;
    }

   private:
    ThreadWorld* w_;
    int r_;
  };

  std::unique_ptr<Rank> rank(int r) { return std::make_unique<Rank>(this, r); }

 private:
  int n_;
  std::barrier<> sync_;
  std::vector<int> oks_;
  std::string shared_;
};

// Runs body(rank, communicator) on n thread ranks at once and joins them;
// returns what each rank's body returned (its error text, "" when none).
inline std::vector<std::string> on_thread_ranks(int n, const std::function<std::string(int, comm::Communicator*)>& body) {
  ThreadWorld world(n);
  std::vector<std::string> out(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto comm = world.rank(r);
      out[static_cast<std::size_t>(r)] = body(r, comm.get());
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace pacer::test
