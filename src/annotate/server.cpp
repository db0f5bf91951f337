// The annotation web app: the embedded page and a small JSON API over the store.
#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>

#include <mutex>
#include <thread>

#include "annotate/assets.hpp"
#include "pacer/annotate.hpp"

namespace pacer::annotate {
namespace {

using nlohmann::json;

std::string page() {
  std::string p(assets::kPage);
  const std::string slot = "/*PACER_ANNOTATE_JS*/";
  p.replace(p.find(slot), slot.size(), assets::kAnnotateJs);
  return p;
}

// The guideline file as it is now: re-read on every request, so an edit made
// while annotators work becomes a new version at once, and labels made under
// the old text keep the old version.
class Guidelines {
 public:
  Guidelines(Store& store, Guideline first) : store_(store), current_(std::move(first)) {}
  Guideline current() {
    std::lock_guard lk(mu_);
    auto g = read_guideline(current_.path);
    if (!g) {
      // Mid-save (the file briefly gone): keep serving the version last read.
      std::fprintf(stderr, "pacer annotate: warning: %s\n", g.error().message.c_str());
      return current_;
    }
    if (g->version != current_.version) {
      if (Status st = store_.add_guideline(*g); !st) {
        std::fprintf(stderr, "pacer annotate: warning: %s\n", st.error().message.c_str());
        return current_;
      }
      std::fprintf(stderr, "pacer annotate: %s changed: guideline version %s (was %s)\n", g->path.c_str(), g->version.c_str(),
                   current_.version.c_str());
      current_ = std::move(*g);
    }
    return current_;
  }

 private:
  Store& store_;
  std::mutex mu_;
  Guideline current_;
};

struct App {
  Store& store;
  std::vector<Label> labels;
  Guidelines guidelines;

  json state(const std::string& annotator, const std::optional<std::string>& show) {
    const Guideline g = guidelines.current();
    json j = {{"annotator", annotator}, {"labels", json::array()},
              {"guideline", {{"version", g.version}, {"path", g.path}, {"text", g.text}}}};
    for (const auto& l : labels) j["labels"].push_back({{"name", l.name}, {"key", l.key}, {"description", l.description}});
    auto next = unwrap(store.next(annotator));
    std::optional<Sample> sample = next.sample;
    if (show) {
      // After an undo the sample taken back comes next, wherever it stands in order.
      if (auto s = unwrap(store.sample(*show))) sample = *s, next.skipped_before = false;
    }
    j["sample"] = sample ? json{{"id", sample->id}, {"text", sample->text}} : json(nullptr);
    j["skipped_before"] = next.skipped_before;
    j["progress"] = {{"samples", next.progress.samples}, {"labelled", next.progress.labelled}, {"skipped", next.progress.skipped}};
    return j;
  }
};

void reply(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_header("Cache-Control", "no-store");
  res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

std::string body_string(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) throw Exception(Error{ErrorKind::kUsage, fmt::format("request: \"{}\" (a string) is missing", key)});
  return it->get<std::string>();
}

// Runs an API call for the annotator the request's token names; errors become JSON.
template <class F>
void api(App& app, const httplib::Request& req, httplib::Response& res, F f) {
  std::string token = req.get_header_value("Authorization");
  if (token.rfind("Bearer ", 0) == 0) token = token.substr(7);
  const auto who = app.store.annotator_for(token);
  if (!who) return reply(res, 401, {{"error", "unknown or missing token: open the link with #token= that pacer annotate printed"}});
  try {
    json body = json::object();
    if (req.method == "POST" && !req.body.empty()) {
      body = json::parse(req.body, nullptr, false);
      if (!body.is_object()) return reply(res, 400, {{"error", "request: the body is not a JSON object"}});
    }
    reply(res, 200, f(*who, body));
  } catch (const Exception& e) {
    reply(res, e.error().kind == ErrorKind::kUsage ? 400 : 500, {{"error", e.error().message}});
  } catch (const std::exception& e) {
    reply(res, 500, {{"error", e.what()}});
  }
}

}  // namespace

Status serve(const ServeOptions& o) {
  auto labels = read_labels(o.labels);
  if (!labels) return labels.error();
  auto guide = read_guideline(o.guidelines);
  if (!guide) return guide.error();
  auto samples = read_samples(o.source);
  if (!samples) return samples.error();
  auto store = Store::open(o.store, true);
  if (!store) return store.error();
  Store& s = **store;
  if (Status st = s.bind_source(o.source); !st) return st;
  if (Status st = s.set_labels(*labels); !st) return st;
  if (Status st = s.add_samples(samples->samples); !st) return st;
  if (Status st = s.add_guideline(*guide); !st) return st;
  std::vector<std::pair<std::string, std::string>> tokens;
  for (const auto& name : o.add_annotators) {
    auto t = s.add_annotator(name);
    if (!t) return t.error();
    tokens.emplace_back(name, *t);
  }
  if (s.annotators().empty())
    return Error{ErrorKind::kUsage, fmt::format("{}: no annotators yet: add one with --add-annotator NAME", o.store)};

  App app{s, *labels, Guidelines(s, *guide)};
  httplib::Server server;
  server.new_task_queue = [] { return new httplib::ThreadPool(16); };
  server.set_keep_alive_timeout(2);
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  server.set_payload_max_length(1 << 20);
  const std::string html = page();
  server.Get("/", [&](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_header("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'");
    res.set_content(html, "text/html; charset=utf-8");
  });
  server.Get("/api/state", [&](const httplib::Request& req, httplib::Response& res) {
    api(app, req, res, [&](const std::string& who, const json&) { return app.state(who, std::nullopt); });
  });
  server.Post("/api/label", [&](const httplib::Request& req, httplib::Response& res) {
    api(app, req, res, [&](const std::string& who, const json& b) {
      unwrap(s.label(who, body_string(b, "sample"), body_string(b, "label"), body_string(b, "guideline_version")));
      return app.state(who, std::nullopt);
    });
  });
  server.Post("/api/skip", [&](const httplib::Request& req, httplib::Response& res) {
    api(app, req, res, [&](const std::string& who, const json& b) {
      unwrap(s.skip(who, body_string(b, "sample")));
      return app.state(who, std::nullopt);
    });
  });
  server.Post("/api/undo", [&](const httplib::Request& req, httplib::Response& res) {
    api(app, req, res, [&](const std::string& who, const json&) {
      auto undone = unwrap(s.undo(who));
      json j = app.state(who, undone);
      j["undone"] = undone ? json(*undone) : json(nullptr);
      return j;
    });
  });

  int port = o.port;
  if (port == 0) {
    port = server.bind_to_any_port(o.bind);
    if (port <= 0) return Error{ErrorKind::kIo, fmt::format("--bind {}: cannot bind", o.bind)};
  } else if (!server.bind_to_port(o.bind, port)) {
    return Error{ErrorKind::kIo, fmt::format("--bind {} --port {}: cannot bind (in use, or not an address of this host)", o.bind, port)};
  }
  // SIGINT and SIGTERM wait for sigwait below: blocked before the server's
  // threads start, so none of them takes the signal.
  sigset_t stop, old;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, &old);
  std::thread listener([&] { server.listen_after_bind(); });
  // bind_to_port already listens: a client connecting now waits in the backlog.
  const bool v6 = o.bind.find(':') != std::string::npos;
  const std::string url = fmt::format("http://{}{}{}:{}/", v6 ? "[" : "", o.bind, v6 ? "]" : "", port);
  if (o.on_ready) o.on_ready(url, tokens, *samples);
  int sig = 0;
  sigwait(&stop, &sig);
  server.stop();
  listener.join();
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return {};
}

}  // namespace pacer::annotate
