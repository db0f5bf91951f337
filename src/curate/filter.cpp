// filter EXPR: a small expression language over score columns, and the
// filtered version (its parent, expression, classifier checksums, counts).
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <set>

#include "curate_internal.hpp"

namespace pacer::curate {

using nlohmann::json;

struct Expr::Node {
  enum Kind { kOr, kAnd, kNot, kCmp, kColumn, kLiteral } kind = kLiteral;
  std::string op;    // kCmp: == != < <= > >=
  std::string name;  // kColumn
  json value;        // kLiteral
  std::vector<std::unique_ptr<Node>> kids;
  std::size_t begin = 0, end = 0;  // its span of the expression text
};

namespace {

constexpr std::size_t kMaxLength = 4096;
constexpr int kMaxDepth = 64;

struct Token {
  enum Kind { kEnd, kIdent, kNumber, kString, kOp, kOpen, kClose } kind = kEnd;
  std::string text;
  json value;
  std::size_t at = 0, end = 0;
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}

  Expected<std::unique_ptr<Expr::Node>> parse() {
    if (Status st = lex(); !st) return st.error();
    auto n = parse_or(0);
    if (!n) return n;
    if (tok().kind != Token::kEnd) return fail(tok().at, fmt::format("unexpected '{}'", tok().text));
    return n;
  }

 private:
  Error fail(std::size_t at, const std::string& why) const {
    return Error{ErrorKind::kUsage, fmt::format("expression, column {}: {}", at + 1, why)};
  }

  Status lex() {
    std::size_t i = 0;
    while (i < s_.size()) {
      const char c = s_[i];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++i;
        continue;
      }
      Token t;
      t.at = i;
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        std::size_t j = i;
        while (j < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[j])) || s_[j] == '_')) ++j;
        t.kind = Token::kIdent;
        t.text = s_.substr(i, j - i);
        i = j;
      } else if (std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-') {
        double v = 0;
        auto [p, ec] = std::from_chars(s_.data() + i, s_.data() + s_.size(), v);
        if (ec != std::errc() || p == s_.data() + i || !std::isfinite(v)) return fail(i, "not a number");
        t.kind = Token::kNumber;
        t.value = v;
        t.text = s_.substr(i, static_cast<std::size_t>(p - (s_.data() + i)));
        i = static_cast<std::size_t>(p - s_.data());
      } else if (c == '"' || c == '\'') {
        std::string out;
        std::size_t j = i + 1;
        for (;; ++j) {
          if (j >= s_.size()) return fail(i, "unterminated string");
          if (s_[j] == c) break;
          if (s_[j] == '\\' && j + 1 < s_.size()) ++j;
          out += s_[j];
        }
        t.kind = Token::kString;
        t.value = out;
        t.text = s_.substr(i, j + 1 - i);
        i = j + 1;
      } else if (c == '(' || c == ')') {
        t.kind = c == '(' ? Token::kOpen : Token::kClose;
        t.text = std::string(1, c);
        ++i;
      } else {
        static const char* kOps[] = {"==", "!=", "<=", ">=", "<", ">"};
        for (const char* op : kOps)
          if (s_.compare(i, std::strlen(op), op) == 0) {
            t.kind = Token::kOp;
            t.text = op;
            break;
          }
        if (t.kind != Token::kOp) return fail(i, fmt::format("unexpected character '{}'", c));
        i += t.text.size();
      }
      t.end = i;
      toks_.push_back(std::move(t));
    }
    Token end;
    end.at = end.end = s_.size();
    end.text = "end of expression";
    toks_.push_back(end);
    return {};
  }

  const Token& tok() const { return toks_[pos_]; }
  bool word(const char* w) const { return tok().kind == Token::kIdent && tok().text == w; }

  using Ptr = std::unique_ptr<Expr::Node>;

  Expected<Ptr> binary(int depth, Expr::Node::Kind kind, const char* w, Expected<Ptr> (Parser::*next)(int)) {
    auto lhs = (this->*next)(depth);
    if (!lhs) return lhs;
    if (!word(w)) return lhs;
    auto n = std::make_unique<Expr::Node>();
    n->kind = kind;
    n->begin = (*lhs)->begin;
    n->kids.push_back(std::move(*lhs));
    while (word(w)) {
      ++pos_;
      auto rhs = (this->*next)(depth);
      if (!rhs) return rhs;
      n->kids.push_back(std::move(*rhs));
    }
    n->end = n->kids.back()->end;
    return Ptr(std::move(n));
  }
  Expected<Ptr> parse_or(int depth) {
    if (depth > kMaxDepth) return fail(tok().at, fmt::format("nested deeper than {} levels", kMaxDepth));
    return binary(depth, Expr::Node::kOr, "or", &Parser::parse_and);
  }
  Expected<Ptr> parse_and(int depth) { return binary(depth, Expr::Node::kAnd, "and", &Parser::parse_not); }
  Expected<Ptr> parse_not(int depth) {
    if (!word("not")) return parse_cmp(depth);
    if (depth > kMaxDepth) return fail(tok().at, fmt::format("nested deeper than {} levels", kMaxDepth));
    const std::size_t at = tok().at;
    ++pos_;
    auto k = parse_not(depth + 1);
    if (!k) return k;
    auto n = std::make_unique<Expr::Node>();
    n->kind = Expr::Node::kNot;
    n->begin = at;
    n->end = (*k)->end;
    n->kids.push_back(std::move(*k));
    return Ptr(std::move(n));
  }
  Expected<Ptr> parse_cmp(int depth) {
    auto lhs = parse_primary(depth);
    if (!lhs) return lhs;
    if (tok().kind != Token::kOp) return lhs;
    auto n = std::make_unique<Expr::Node>();
    n->kind = Expr::Node::kCmp;
    n->op = tok().text;
    ++pos_;
    auto rhs = parse_primary(depth);
    if (!rhs) return rhs;
    n->begin = (*lhs)->begin;
    n->end = (*rhs)->end;
    n->kids.push_back(std::move(*lhs));
    n->kids.push_back(std::move(*rhs));
    if (tok().kind == Token::kOp) return fail(tok().at, "chained comparison (use and)");
    return Ptr(std::move(n));
  }
  Expected<Ptr> parse_primary(int depth) {
    const Token& t = tok();
    auto n = std::make_unique<Expr::Node>();
    n->begin = t.at;
    n->end = t.end;
    switch (t.kind) {
      case Token::kOpen: {
        ++pos_;
        auto inner = parse_or(depth + 1);
        if (!inner) return inner;
        if (tok().kind != Token::kClose) return fail(tok().at, fmt::format("expected ')' before {}", tok().text));
        (*inner)->begin = t.at;
        (*inner)->end = tok().end;
        ++pos_;
        return inner;
      }
      case Token::kNumber:
      case Token::kString:
        n->value = t.value;
        ++pos_;
        return Ptr(std::move(n));
      case Token::kIdent:
        if (t.text == "true" || t.text == "false") n->value = t.text == "true";
        else if (t.text == "null") n->value = nullptr;
        else if (t.text == "and" || t.text == "or" || t.text == "not") return fail(t.at, fmt::format("'{}' where a value belongs", t.text));
        else {
          n->kind = Expr::Node::kColumn;
          n->name = t.text;
        }
        ++pos_;
        return Ptr(std::move(n));
      default:
        return fail(t.at, t.kind == Token::kEnd ? "the expression ends where a value belongs" : fmt::format("'{}' where a value belongs", t.text));
    }
  }

  const std::string& s_;
  std::vector<Token> toks_;
  std::size_t pos_ = 0;
};

using Lookup = std::function<const json&(const std::string&)>;

const json& operand(const Expr::Node& n, const Lookup& value) { return n.kind == Expr::Node::kColumn ? value(n.name) : n.value; }

bool truthy(const json& v) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  return false;
}

template <class T>
bool compare(const T& a, const T& b, const std::string& op) {
  if (op == "==") return a == b;
  if (op == "!=") return a != b;
  if (op == "<") return a < b;
  if (op == "<=") return a <= b;
  if (op == ">") return a > b;
  return a >= b;
}

bool eval(const Expr::Node& n, const Lookup& value) {
  switch (n.kind) {
    case Expr::Node::kOr:
      for (const auto& k : n.kids)
        if (eval(*k, value)) return true;
      return false;
    case Expr::Node::kAnd:
      for (const auto& k : n.kids)
        if (!eval(*k, value)) return false;
      return true;
    case Expr::Node::kNot: return !eval(*n.kids[0], value);
    case Expr::Node::kCmp: {
      const json& a = operand(*n.kids[0], value);
      const json& b = operand(*n.kids[1], value);
      if (a.is_null() || b.is_null()) return false;
      if (a.is_number() && b.is_number()) return compare(a.get<double>(), b.get<double>(), n.op);
      if (a.is_string() && b.is_string()) return compare(a.get_ref<const std::string&>(), b.get_ref<const std::string&>(), n.op);
      if (a.is_boolean() && b.is_boolean() && (n.op == "==" || n.op == "!=")) return compare(a.get<bool>(), b.get<bool>(), n.op);
      return false;
    }
    default: return truthy(operand(n, value));
  }
}

void collect(const Expr::Node& n, std::set<std::string>& out) {
  if (n.kind == Expr::Node::kColumn) out.insert(n.name);
  for (const auto& k : n.kids) collect(*k, out);
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

}  // namespace

Expr::~Expr() = default;
Expr::Expr(Expr&&) noexcept = default;
Expr& Expr::operator=(Expr&&) noexcept = default;

Expected<Expr> Expr::parse(const std::string& text) {
  if (text.size() > kMaxLength) return Error{ErrorKind::kUsage, fmt::format("expression of {} bytes (at most {})", text.size(), kMaxLength)};
  if (text.find('\0') != std::string::npos) return Error{ErrorKind::kUsage, "expression contains a NUL byte"};
  Parser p(text);
  auto root = p.parse();
  if (!root) return root.error();
  Expr e;
  e.text_ = text;
  if ((*root)->kind == Node::kAnd) {
    for (auto& k : (*root)->kids) e.clauses_.push_back(std::move(k));
  } else {
    e.clauses_.push_back(std::move(*root));
  }
  for (const auto& c : e.clauses_) e.clause_text_.push_back(trim(text.substr(c->begin, c->end - c->begin)));
  return e;
}

std::vector<std::string> Expr::clauses() const { return clause_text_; }

std::vector<std::string> Expr::columns() const {
  std::set<std::string> s;
  for (const auto& c : clauses_) collect(*c, s);
  return {s.begin(), s.end()};
}

bool Expr::eval_clause(std::size_t k, const Lookup& value) const { return eval(*clauses_.at(k), value); }

Expected<FilterReport> filter(const Store& store, const Manifest& parent, const std::string& expression, bool strict) {
  auto expr = Expr::parse(expression);
  if (!expr) return expr.error();
  std::vector<std::string> have;
  for (const auto& c : parent.columns) have.push_back(c.name);
  std::vector<const Column*> cols;
  for (const auto& name : expr->columns()) {
    const Column* found = nullptr;
    for (const auto& c : parent.columns)
      if (c.name == name) found = &c;
    if (!found)
      return Error{ErrorKind::kUsage, fmt::format("expression: unknown score '{}' (version {} has {})", name, parent.version,
                                                  have.empty() ? std::string("no scores: run pacer curate classify, dedup or decontaminate first")
                                                               : fmt::format("{}", fmt::join(have, ", ")))};
    cols.push_back(found);
  }
  std::vector<std::vector<std::vector<json>>> values;
  json identity = {{"expression", expression}, {"columns", json::object()}};
  json classifiers = json::object();
  for (const Column* c : cols) {
    auto v = read_column(*c);
    if (!v) return v.error();
    values.push_back(std::move(*v));
    identity["columns"][c->name] = c->xxh3;
    classifiers[c->name] = {{"version", c->version}, {"xxh3", c->xxh3}, {"source", c->source}};
  }
  FilterReport r;
  for (const auto& t : expr->clauses()) r.clauses.push_back({t, 0, 0});
  r.version = derive(parent, "filter", identity, {{"expression", expression}, {"clauses", expr->clauses()}, {"columns", classifiers}});
  auto vs = load_samples(store, parent, false, strict);
  if (!vs) return vs.error();
  r.malformed = vs->malformed;
  const std::vector<std::string> names = expr->columns();
  static const json kNull = nullptr;
  std::string dropped;
  for (const auto& s : vs->samples) {
    const std::size_t at = row_index(parent.inputs[s.input], s.row);
    auto lookup = [&](const std::string& name) -> const json& {
      const auto k = static_cast<std::size_t>(std::lower_bound(names.begin(), names.end(), name) - names.begin());
      const auto& col = values[k][s.input];
      return at < col.size() ? col[at] : kNull;
    };
    ++r.samples;
    std::optional<std::size_t> first;
    for (std::size_t k = 0; k < r.clauses.size(); ++k)
      if (!expr->eval_clause(k, lookup)) {
        ++r.clauses[k].failed;
        if (!first) first = k;
      }
    if (!first) {
      ++r.kept;
      continue;
    }
    ++r.dropped;
    ++r.clauses[*first].dropped;
    dropped += json{{"input", s.input}, {"row", s.row}, {"id", s.id}, {"rule", r.clauses[*first].text}}.dump(-1, ' ', false,
                                                                                                            json::error_handler_t::replace);
    dropped += '\n';
  }
  json per = json::array();
  for (const auto& c : r.clauses) per.push_back({{"clause", c.text}, {"failed", c.failed}, {"dropped", c.dropped}});
  r.version.counts = {{"samples", r.kept}, {"parent_samples", r.samples}, {"kept", r.kept}, {"dropped", r.dropped}, {"clauses", per},
                      {"rows", vs->rows}, {"malformed", r.malformed.count}};
  if (Status st = store.write(r.version, dropped); !st) return st.error();
  return r;
}

json to_json(const FilterReport& r) {
  json per = json::array();
  for (const auto& c : r.clauses) per.push_back({{"clause", c.text}, {"failed", c.failed}, {"dropped", c.dropped}});
  return {{"schema", "pacer.curate.filter/1"}, {"version", r.version.version}, {"parent", r.version.parent},
          {"expression", r.version.parameters["expression"]}, {"samples", r.samples}, {"kept", r.kept}, {"dropped", r.dropped},
          {"clauses", per}, {"columns", r.version.parameters["columns"]}, {"malformed", to_json(r.malformed)}};
}

}  // namespace pacer::curate
