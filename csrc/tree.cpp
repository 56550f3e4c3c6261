// DDTree host ops (SPEC section 5): the best-first tree build and the walk of
// the verified tree. Both run on the CPU: the tree is small (a few hundred
// nodes), its build is a sequential priority-queue loop, and the walk decides
// what the host commits. The Python reference of both is
// dflash_kernels/reference/tree.py; the two must agree bit for bit.
//
// build_tree(top_logprobs [D, K] float64, top_ids [D, K] int64, budget)
//   Row d of the inputs is depth d + 1, sorted best first. A max-priority
//   queue holds candidate nodes keyed by the sum of log-probs along their path
//   from the root. It starts with (depth 1, rank 0, parent root). Each pop
//   appends the candidate as node n (numbered 1, 2, ... in pop order) and
//   pushes (a) its next sibling (same parent, rank + 1, same depth) when
//   rank + 1 < K, then (b) its first child (rank 0, depth + 1, parent n) when
//   depth < D. The loop stops at `budget` nodes or an empty queue.
//   Scores are computed as score(parent) + logprob[depth - 1][rank] in double
//   precision (the parent's score rides along in the queue entry), which is
//   the path sum without the cancellation of "score - old + new". Ties in the
//   score pop the entry pushed first (lower insertion counter).
//
// walk_tree(parents [N+1], token_ids [N], target_choice [N+1])
//   From the root (node 0): while target_choice[cur] equals the token of a
//   child of cur, move to that child (the lowest-numbered one, should two
//   children share a token). Returns the visited nodes and the bonus token
//   target_choice[last].
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <queue>
#include <string>
#include <tuple>
#include <vector>

namespace dflash {
namespace {

struct Candidate {
  double score;         // sum of log-probs from the root to this candidate
  double parent_score;  // score of its parent (0 for the root)
  int64_t counter;      // insertion order: the tie-break, lower pops first
  int64_t depth;        // 1-based depth, row depth - 1 of the inputs
  int64_t rank;         // column of the inputs
  int64_t parent;       // node index of the parent (0 = root)
};

// std::priority_queue pops the *largest* element under this "less than".
struct PopsLater {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.score != b.score) return a.score < b.score;
    return a.counter > b.counter;
  }
};

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> build_tree_cpu(
    const torch::Tensor& top_logprobs_in, const torch::Tensor& top_ids_in, int64_t budget) {
  TORCH_CHECK(top_logprobs_in.dim() == 2, "build_tree: top_logprobs must be 2-D [depth, K], got shape ",
              top_logprobs_in.sizes());
  TORCH_CHECK(top_ids_in.sizes() == top_logprobs_in.sizes(), "build_tree: top_ids must have the shape of top_logprobs ",
              top_logprobs_in.sizes(), ", got ", top_ids_in.sizes());
  TORCH_CHECK(top_logprobs_in.device().is_cpu() && top_ids_in.device().is_cpu(),
              "build_tree (C++): inputs must be CPU tensors");
  TORCH_CHECK(at::isFloatingType(top_logprobs_in.scalar_type()), "build_tree: top_logprobs must be floating point, got ",
              top_logprobs_in.scalar_type());
  TORCH_CHECK(top_ids_in.scalar_type() == torch::kInt64 || top_ids_in.scalar_type() == torch::kInt32,
              "build_tree: top_ids must be int64 or int32, got ", top_ids_in.scalar_type());
  TORCH_CHECK(budget >= 0, "build_tree: budget must be >= 0, got ", budget);

  const torch::Tensor logprobs = top_logprobs_in.to(torch::kFloat64).contiguous();
  const torch::Tensor ids = top_ids_in.to(torch::kInt64).contiguous();
  const int64_t max_depth = logprobs.size(0);
  const int64_t k = logprobs.size(1);
  const double* lp = logprobs.data_ptr<double>();
  const int64_t* tok = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < max_depth * k; ++i) {
    TORCH_CHECK(!std::isnan(lp[i]), "build_tree: top_logprobs contains NaN (row ", i / k, ", column ", i % k, ")");
  }

  std::vector<int64_t> token_ids;
  std::vector<int64_t> depths;
  std::vector<int64_t> parents{-1};
  const int64_t reserve = budget < 1 << 20 ? budget : 1 << 20;
  token_ids.reserve(reserve);
  depths.reserve(reserve);
  parents.reserve(reserve + 1);

  std::vector<Candidate> storage;
  storage.reserve(2 * reserve + 1);
  std::priority_queue<Candidate, std::vector<Candidate>, PopsLater> queue(PopsLater(), std::move(storage));
  int64_t counter = 0;
  if (budget > 0 && max_depth > 0 && k > 0) {
    queue.push(Candidate{lp[0], 0.0, counter++, 1, 0, 0});
  }
  while (!queue.empty() && static_cast<int64_t>(token_ids.size()) < budget) {
    const Candidate c = queue.top();
    queue.pop();
    const int64_t row = c.depth - 1;
    token_ids.push_back(tok[row * k + c.rank]);
    depths.push_back(c.depth);
    parents.push_back(c.parent);
    const int64_t node = static_cast<int64_t>(token_ids.size());
    if (c.rank + 1 < k) {
      queue.push(Candidate{c.parent_score + lp[row * k + c.rank + 1], c.parent_score, counter++, c.depth, c.rank + 1,
                           c.parent});
    }
    if (c.depth < max_depth) {
      queue.push(Candidate{c.score + lp[(row + 1) * k], c.score, counter++, c.depth + 1, 0, node});
    }
  }

  const auto opts = torch::TensorOptions().dtype(torch::kInt64);
  const int64_t n = static_cast<int64_t>(token_ids.size());
  torch::Tensor out_tokens = torch::empty({n}, opts);
  torch::Tensor out_depths = torch::empty({n}, opts);
  torch::Tensor out_parents = torch::empty({n + 1}, opts);
  std::copy(token_ids.begin(), token_ids.end(), out_tokens.data_ptr<int64_t>());
  std::copy(depths.begin(), depths.end(), out_depths.data_ptr<int64_t>());
  std::copy(parents.begin(), parents.end(), out_parents.data_ptr<int64_t>());
  return {out_tokens, out_depths, out_parents};
}

std::tuple<torch::Tensor, int64_t> walk_tree_cpu(const torch::Tensor& parents_in, const torch::Tensor& token_ids_in,
                                                 const torch::Tensor& target_choice_in) {
  TORCH_CHECK(parents_in.dim() == 1 && parents_in.size(0) >= 1,
              "walk_tree: parents must be 1-D [N+1] with N+1 >= 1, got shape ", parents_in.sizes());
  const int64_t n_nodes = parents_in.size(0);  // N + 1, the root included
  TORCH_CHECK(token_ids_in.dim() == 1 && token_ids_in.size(0) == n_nodes - 1, "walk_tree: token_ids must be 1-D [N] = [",
              n_nodes - 1, "], got shape ", token_ids_in.sizes());
  TORCH_CHECK(target_choice_in.dim() == 1 && target_choice_in.size(0) == n_nodes,
              "walk_tree: target_choice must be 1-D [N+1] = [", n_nodes, "], got shape ", target_choice_in.sizes());
  for (const torch::Tensor* t : {&parents_in, &token_ids_in, &target_choice_in}) {
    TORCH_CHECK(t->device().is_cpu(), "walk_tree (C++): inputs must be CPU tensors");
    TORCH_CHECK(t->scalar_type() == torch::kInt64 || t->scalar_type() == torch::kInt32,
                "walk_tree: parents, token_ids and target_choice must be int64 or int32, got ", t->scalar_type());
  }
  const torch::Tensor parents_t = parents_in.to(torch::kInt64).contiguous();
  const torch::Tensor tokens_t = token_ids_in.to(torch::kInt64).contiguous();
  const torch::Tensor choice_t = target_choice_in.to(torch::kInt64).contiguous();
  const int64_t* parents = parents_t.data_ptr<int64_t>();
  const int64_t* tokens = tokens_t.data_ptr<int64_t>();
  const int64_t* choice = choice_t.data_ptr<int64_t>();

  TORCH_CHECK(parents[0] == -1, "walk_tree: parents[0] must be -1 (the root), got ", parents[0]);
  // Children lists in compressed form: child_start[p] .. child_start[p + 1]
  // index `children`, which lists each node's children in increasing order.
  std::vector<int64_t> child_start(n_nodes + 1, 0);
  for (int64_t i = 1; i < n_nodes; ++i) {
    TORCH_CHECK(parents[i] >= 0 && parents[i] < i, "walk_tree: parents[", i, "] = ", parents[i],
                " must lie in [0, ", i, ") (a parent precedes its children)");
    ++child_start[parents[i] + 1];
  }
  for (int64_t p = 0; p < n_nodes; ++p) child_start[p + 1] += child_start[p];
  std::vector<int64_t> fill(child_start.begin(), child_start.end() - 1);
  std::vector<int64_t> children(n_nodes > 0 ? n_nodes - 1 : 0);
  for (int64_t i = 1; i < n_nodes; ++i) children[fill[parents[i]]++] = i;

  std::vector<int64_t> accepted{0};
  int64_t cur = 0;
  while (true) {
    int64_t next = -1;
    for (int64_t c = child_start[cur]; c < child_start[cur + 1]; ++c) {
      if (tokens[children[c] - 1] == choice[cur]) {
        next = children[c];
        break;
      }
    }
    if (next < 0) break;
    accepted.push_back(next);
    cur = next;
  }
  torch::Tensor out = torch::empty({static_cast<int64_t>(accepted.size())}, torch::TensorOptions().dtype(torch::kInt64));
  std::copy(accepted.begin(), accepted.end(), out.data_ptr<int64_t>());
  return {out, choice[cur]};
}

}  // namespace

void register_tree_ops(pybind11::module_& m) {
  m.def("build_tree", &build_tree_cpu, pybind11::arg("top_logprobs"), pybind11::arg("top_ids"), pybind11::arg("budget"),
        "Best-first DDTree build on CPU tensors: returns (token_ids [N], depths [N], parents [N+1]) as int64");
  m.def("walk_tree", &walk_tree_cpu, pybind11::arg("parents"), pybind11::arg("token_ids"),
        pybind11::arg("target_choice"),
        "Walk of a verified DDTree on CPU tensors: returns (accepted node indices [A] int64, bonus token)");
}

}  // namespace dflash
