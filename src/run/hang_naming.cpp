// Naming the rank that hung. When one rank stops inside its compute, the
// others block in the next collective and stop heartbeating at the same step,
// a moment later: steps and idle times alone cannot tell them apart, the
// stacks can (the culprit is the one not waiting).
#include "run/hang_naming.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>

namespace pacer::run {
namespace {

using nlohmann::json;

struct Frame {
  std::string_view file, func;
  std::string_view line;
};

// `  File "PATH", line N in FUNC`, as faulthandler writes a frame.
std::optional<Frame> parse_frame(std::string_view s) {
  constexpr std::string_view kHead = "  File \"";
  if (s.substr(0, kHead.size()) != kHead) return std::nullopt;
  s.remove_prefix(kHead.size());
  const auto q = s.rfind("\", line ");
  if (q == std::string_view::npos) return std::nullopt;
  Frame f;
  f.file = s.substr(0, q);
  s.remove_prefix(q + 8);
  const auto in = s.find(" in ");
  if (in == std::string_view::npos) return std::nullopt;
  f.line = s.substr(0, in);
  f.func = s.substr(in + 4);
  return f;
}

// The frames of the first thread in the dump, innermost first.
std::vector<Frame> first_thread(std::string_view text) {
  std::vector<Frame> frames;
  bool in_thread = false;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.size() >= 26 && line.substr(line.size() - 26) == "(most recent call first):") {
      if (in_thread) break;  // the next thread
      in_thread = true;
      continue;
    }
    if (auto f = parse_frame(line)) {
      in_thread = true;  // a dump without a header (one thread)
      frames.push_back(*f);
    } else if (in_thread && line.empty() && !frames.empty()) {
      break;
    }
  }
  return frames;
}

// A library whose blocking collectives show as Python frames.
struct Library {
  std::string_view path_part;  // in the frame's file
  std::string_view prefix;     // the op's name
  std::vector<std::string_view> ops;
};

const std::array<Library, 2>& libraries() {
  static const std::array<Library, 2> libs = {{
      {"/torch/distributed/",
       "torch.distributed.",
       {"all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
        "all_gather_coalesced", "_all_gather_base", "broadcast", "broadcast_object_list", "barrier",
        "monitored_barrier", "_store_based_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
        "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
        "scatter_object_list", "send", "recv", "send_object_list", "recv_object_list", "new_group", "wait",
        "wait_tensor"}},
      // mpi4py's Comm methods are compiled (no Python frame); its pure Python
      // layers (mpi4py.util.pkl5) do show.
      {"/mpi4py/",
       "mpi4py.",
       {"barrier", "Barrier", "bcast", "Bcast", "allreduce", "Allreduce", "reduce", "Reduce", "allgather", "Allgather",
        "gather", "Gather", "scatter", "Scatter", "alltoall", "Alltoall", "send", "Send", "recv", "Recv", "ssend",
        "sendrecv", "Sendrecv", "wait", "Wait", "waitall", "Waitall"}},
  }};
  return libs;
}

std::string_view basename(std::string_view p) {
  const auto slash = p.rfind('/');
  return slash == std::string_view::npos ? p : p.substr(slash + 1);
}

std::string ranks_text(const std::vector<Suspect>& s, const std::vector<std::size_t>& idx) {
  std::string out = idx.size() == 1 ? "rank " : "ranks ";
  for (std::size_t k = 0; k < idx.size(); ++k) {
    if (k) out += ',';
    out += std::to_string(s[idx[k]].rank);
    if (!s[idx[k]].host.empty() && (k + 1 == idx.size() || s[idx[k + 1]].host != s[idx[k]].host))
      out += " on " + s[idx[k]].host;
  }
  return out;
}

std::string wait_text(const CollectiveWait& w) { return w.op + (w.site.empty() ? "" : " (" + w.site + ")"); }

}  // namespace

std::optional<CollectiveWait> collective_wait(std::string_view text) {
  const auto frames = first_thread(text);
  if (frames.empty()) return std::nullopt;
  for (const auto& lib : libraries()) {
    // The innermost frames inside the library; the outermost collective among
    // them is the call the program made (all_gather_object, not the
    // all_gather inside it).
    std::optional<CollectiveWait> found;
    std::size_t k = 0;
    for (; k < frames.size() && frames[k].file.find(lib.path_part) != std::string_view::npos; ++k)
      if (std::find(lib.ops.begin(), lib.ops.end(), frames[k].func) != lib.ops.end())
        found = CollectiveWait{fmt::format("{}{}", lib.prefix, frames[k].func), ""};
    if (!found) continue;
    if (k < frames.size())
      found->site = fmt::format("{}:{} in {}", basename(frames[k].file), frames[k].line, frames[k].func);
    return found;
  }
  return std::nullopt;
}

Naming name_hung_rank(const std::vector<Suspect>& s, double window_s) {
  Naming n;
  if (s.empty()) return n;
  double longest = 0;
  for (const auto& x : s) longest = std::max(longest, x.idle_s);
  std::vector<std::size_t> cand;
  for (std::size_t i = 0; i < s.size(); ++i)
    if (s[i].idle_s >= longest - window_s) cand.push_back(i);
  std::vector<std::string> why;
  auto decide = [&](std::size_t i, const char* rule) {
    n.index = i;
    n.rule = rule;
    std::string r;
    for (const auto& w : why) r += (r.empty() ? "" : "; ") + w;
    n.reason = r;
    return n;
  };
  if (cand.size() == 1) {
    if (s.size() == 1) {
      why.push_back("the only rank watched");
    } else {
      std::vector<std::size_t> others;
      for (std::size_t i = 0; i < s.size(); ++i)
        if (i != cand[0]) others.push_back(i);
      why.push_back(fmt::format("{} stopped first; {} heartbeated more than {:.1f} s after it", ranks_text(s, cand),
                                ranks_text(s, others), window_s));
    }
    return decide(cand[0], "alone");
  }

  // (2) The lowest last step: the ranks waiting behind a stopped one may have
  // finished one step more. Only when every candidate reported a step.
  if (std::all_of(cand.begin(), cand.end(), [&](std::size_t i) { return s[i].step.has_value(); })) {
    std::uint64_t low = *s[cand[0]].step;
    for (auto i : cand) low = std::min(low, *s[i].step);
    std::vector<std::size_t> lows, highs;
    for (auto i : cand) (*s[i].step == low ? lows : highs).push_back(i);
    if (!highs.empty()) {
      why.push_back(fmt::format("{} stopped at step {}, {} later", ranks_text(s, lows), low, ranks_text(s, highs)));
      cand = lows;
      if (cand.size() == 1) return decide(cand[0], "step");
    }
  }

  // (3) The stacks.
  std::vector<std::optional<CollectiveWait>> waits(s.size());
  std::vector<std::size_t> waiting, other;
  for (auto i : cand) {
    if (s[i].stacks) waits[i] = collective_wait(*s[i].stacks);
    (waits[i] ? waiting : other).push_back(i);
  }
  std::vector<std::size_t> culprits, silent, elsewhere;
  for (auto i : other) (s[i].stacks ? elsewhere : silent).push_back(i);
  // The waiting ranks, grouped by what they wait in (op and call site), in
  // the order first seen.
  std::vector<std::pair<std::string, std::vector<std::size_t>>> groups;
  for (auto i : waiting) {
    const std::string key = wait_text(*waits[i]);
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == key; });
    if (g == groups.end())
      groups.push_back({key, {i}});
    else
      g->second.push_back(i);
  }
  auto groups_text = [&](const std::vector<std::pair<std::string, std::vector<std::size_t>>>& gs) {
    std::string t;
    for (const auto& [key, idx] : gs)
      t += fmt::format("{}{} wait{} in {}", t.empty() ? "" : ", ", ranks_text(s, idx), idx.size() == 1 ? "s" : "", key);
    return t;
  };
  auto others_text = [&] {
    std::string t;
    if (!elsewhere.empty())
      t += fmt::format("{} do{} not", ranks_text(s, elsewhere), elsewhere.size() == 1 ? "es" : "");
    if (!silent.empty()) t += fmt::format("{}{} gave no stacks", t.empty() ? "" : "; ", ranks_text(s, silent));
    return t;
  };
  if (!waiting.empty() && !other.empty()) {
    // A rank that no collective holds while others wait is what they wait
    // for. One seen elsewhere goes before one that gave no stacks (which may
    // only have been slow to write them).
    why.push_back(groups_text(groups) + "; " + others_text());
    culprits = elsewhere.empty() ? silent : elsewhere;
  } else if (groups.size() > 1) {
    // All wait, in different collectives: the odd ones out entered one that
    // the majority skipped (or skipped the one it is in).
    auto big = std::max_element(groups.begin(), groups.end(),
                                [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    const auto size = big->second.size();
    if (std::count_if(groups.begin(), groups.end(), [&](const auto& g) { return g.second.size() == size; }) == 1) {
      std::vector<std::pair<std::string, std::vector<std::size_t>>> rest;
      for (const auto& g : groups)
        if (&g != &*big) {
          rest.push_back(g);
          culprits.insert(culprits.end(), g.second.begin(), g.second.end());
        }
      why.push_back(fmt::format("{}; {}", groups_text({*big}), groups_text(rest)));
    } else {
      why.push_back(groups_text(groups) + ": no collective that most of them wait in");
    }
  } else if (!waiting.empty()) {
    why.push_back(groups_text(groups) + ": the stacks do not single one out");
  } else {
    why.push_back("none of them waits in a collective (" + others_text() + ")");
  }
  if (!culprits.empty()) cand = culprits;

  // (4) idle longest, (5) lowest rank.
  std::size_t best = cand[0];
  for (auto i : cand)
    if (s[i].idle_s > s[best].idle_s || (s[i].idle_s == s[best].idle_s && s[i].rank < s[best].rank)) best = i;
  if (culprits.size() == 1) return decide(best, "stacks");
  why.push_back(fmt::format("{} stopped first ({:.1f} s without a heartbeat)", ranks_text(s, {best}), s[best].idle_s));
  return decide(best, culprits.empty() ? "first-stopped" : "stacks");
}

void attach_stacks(std::vector<Suspect>& suspects, json& stacks) {
  if (!stacks.is_array()) return;
  for (auto& e : stacks) {
    if (!e.is_object()) continue;
    const json text = e.value("text", json());
    std::optional<CollectiveWait> w;
    if (text.is_string()) w = collective_wait(text.get_ref<const std::string&>());
    e["collective"] = w ? json{{"op", w->op}, {"site", w->site}} : json(nullptr);
    if (!text.is_string() || !e.value("rank", json()).is_number_integer()) continue;
    const int rank = e["rank"].get<int>();
    const std::string host = e.value("host", std::string());
    for (auto& x : suspects)
      if (x.rank == rank && x.host == host) x.stacks = text.get<std::string>();
  }
}

json naming_json(const std::vector<Suspect>& suspects, const Naming& n) {
  json j = {{"rank", suspects.at(n.index).rank}, {"rule", n.rule}, {"reason", n.reason}};
  if (!suspects[n.index].host.empty()) j["host"] = suspects[n.index].host;
  return j;
}

}  // namespace pacer::run
