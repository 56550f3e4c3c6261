// DDTree host ops: the best-first tree build and the walk of the verified
// tree. Both run on the CPU: the tree is small (a few hundred nodes), its
// build is a sequential priority-queue loop, and the walk decides what the
// host commits. The Python reference of both is
// dflash_kernels/reference/tree.py; the two must agree bit for bit.
//
// build_tree(top_logprobs [(b,) D, K] float, top_ids [(b,) D, K] int64/int32, budget)
//   Row d of the inputs is depth d + 1, sorted best first. A max-priority
//   queue holds candidate nodes keyed by the sum of log-probs along their path
//   from the root. It starts with (depth 1, rank 0, parent root). Each pop
//   appends the candidate as node n (numbered 1, 2, ... in pop order) and
//   pushes (a) its next sibling (same parent, rank + 1, same depth) when
//   rank + 1 < K, then (b) its first child (rank 0, depth + 1, parent n) when
//   depth < D. The loop stops at `budget` nodes or an empty queue.
//   Scores are computed as score(parent) + logprob[depth - 1][rank] in double
//   precision (the parent's score is looked up per popped node), which is the
//   path sum without the cancellation of "score - old + new".
//   Tie rule (the one of every tree build, dflash_kernels.build_tree_device's
//   too): nodes come in the order (score desc, depth asc, parent asc, rank
//   asc). The queue holds at most one candidate per parent (a parent's
//   children enter one at a time, each after the one before it pops), so
//   (score, depth, parent) orders its entries totally and rank never decides;
//   every candidate pushed later than another of its chain (a next sibling: a
//   higher rank; a first child: a greater depth) also comes later in the
//   order whenever their scores tie, so the pops follow the order exactly.
//   Parents are node numbers, which within one depth follow the same order:
//   "parent asc" is the device build's "parent's slot asc".
//   The node count n = min(budget, sum_{d=1..D} K^d) is known up front (the
//   queue only runs empty once the whole tree is popped), so the loop writes
//   straight into the preallocated outputs, with each node's score (its path
//   sum, double), non-increasing in node order. [b, D, K] inputs build b
//   trees, one loop per row, into [b, ...] outputs. Inputs are read in place
//   (float32/float64, int64/int32, any strides), with no conversion copies.
//   Queue entries are 128-bit integer keys (score, then ~depth, ~parent), so
//   each heap comparison is one unsigned compare (see make_key below).
//
// walk_tree(parents [N+1], token_ids [N], target_choice [N+1])
//   From the root (node 0): while target_choice[cur] equals the token of a
//   child of cur, move to that child (the lowest-numbered one, should two
//   children share a token). Returns the visited nodes and the bonus token
//   target_choice[last].
//
// walk_tree_padded(parents [(b,) N+1], token_ids [(b,) N], target_choice [(b,) N+1], max_depth D)
//   The same walk of each tree of a batch in one call, in the layout of
//   dflash_kernels.walk_tree_device: path [(b,) D+1] (the accepted nodes),
//   path_len [b] (or [1]: their count M), committed [(b,) D+1] (the tokens of
//   nodes path[1..M-1], then the bonus), every unused slot 0.
#include <ATen/EmptyTensor.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dflash {
namespace {

// Queue entries are single 128-bit keys: high 64 bits = the score mapped to
// an unsigned integer in the same order (sign-magnitude to offset binary),
// low 64 bits = (~depth << 32) | ~parent (32 bits each), so "pops first"
// (higher score, then lower depth, then lower parent) is one unsigned
// compare; the queue never holds two entries of one parent, so keys are
// unique, the order is total and the pop sequence cannot depend on the heap's
// layout. Scores get `+ 0.0` first, which turns -0.0 into +0.0 (they compare
// equal as doubles, so they must map to one key) and changes no other value.
// The candidate's rank lives in a side array indexed by its parent.
using Key = unsigned __int128;

inline uint64_t score_bits(double score) {
  score += 0.0;
  uint64_t b;
  std::memcpy(&b, &score, sizeof b);
  return (b >> 63) ? ~b : (b | (uint64_t{1} << 63));
}

inline double bits_score(uint64_t o) {
  const uint64_t b = (o >> 63) ? (o & ~(uint64_t{1} << 63)) : ~o;
  double score;
  std::memcpy(&score, &b, sizeof score);
  return score;
}

inline Key make_key(double score, uint32_t depth, uint32_t parent) {
  const uint64_t tie = (uint64_t{~depth} << 32) | uint64_t{~parent};
  return (Key{score_bits(score)} << 64) | Key{tie};
}

inline uint32_t key_depth(const Key key) { return ~static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32); }
inline uint32_t key_parent(const Key key) { return ~static_cast<uint32_t>(static_cast<uint64_t>(key)); }

// Binary max-heap of keys on a preallocated array, with hole-based sifts and
// a replace-top operation: a pop followed by the push of the popped entry's
// sibling is one sift-down instead of a sift-down plus a sift-up.
class KeyHeap {
 public:
  explicit KeyHeap(Key* storage) : h_(storage) {}
  Key top() const { return h_[0]; }

  void push(const Key c) {
    int64_t i = size_++;
    while (i > 0) {
      const int64_t p = (i - 1) >> 1;
      if (!(c > h_[p])) break;
      h_[i] = h_[p];
      i = p;
    }
    h_[i] = c;
  }
  // Removes the top and inserts `c` (one sift-down from the root).
  void replace_top(const Key c) { sift_down(c); }
  // Removes the top.
  void pop() {
    --size_;
    if (size_ > 0) sift_down(h_[size_]);
  }

 private:
  // Sift-down from the root, the winning child chosen without a branch. (The
  // entry placed at the top is often the popped entry's next sibling, which
  // still ranks high, so stopping early beats Floyd's walk to a leaf.)
  void sift_down(const Key c) {
    int64_t i = 0;
    while (true) {
      int64_t child = 2 * i + 1;
      if (child >= size_) break;
      if (child + 1 < size_) child += (h_[child + 1] > h_[child]);
      if (!(h_[child] > c)) break;
      h_[i] = h_[child];
      i = child;
    }
    h_[i] = c;
  }

  Key* h_;
  int64_t size_ = 0;
};

// Nodes of the full tree, sum_{d=1..D} K^d, saturated at `cap`.
int64_t full_tree_nodes(int64_t max_depth, int64_t k, int64_t cap) {
  int64_t total = 0;
  int64_t level = 1;
  for (int64_t d = 1; d <= max_depth && total < cap; ++d) {
    if (k != 0 && level > cap / k) return cap;
    level *= k;
    if (level == 0) break;
    total += level;
  }
  return total < cap ? total : cap;
}

// The heap loop on typed, strided inputs. Writes node i + 1's depth to
// depths[i], its parent to parents[i + 1] and its token to tokens[i].
template <typename lp_t, typename id_t>
void build_tree_loop(const lp_t* lp, int64_t lp_s0, int64_t lp_s1, const id_t* ids, int64_t id_s0, int64_t id_s1,
                     int64_t max_depth, int64_t k, int64_t n, int64_t* tokens, int64_t* depths, int64_t* parents,
                     double* scores) {
  // NaN anywhere is an error, as in the reference (which checks every entry).
  for (int64_t d = 0; d < max_depth; ++d) {
    const lp_t* row = lp + d * lp_s0;
    for (int64_t r = 0; r < k; ++r) {
      TORCH_CHECK(!std::isnan(static_cast<double>(row[r * lp_s1])), "build_tree: top_logprobs contains NaN (row ", d,
                  ", column ", r, ")");
    }
  }
  parents[0] = -1;
  if (n == 0) return;
  auto logprob = [&](int64_t row, int64_t rank) { return static_cast<double>(lp[row * lp_s0 + rank * lp_s1]); };
  // A heap of at most n + 1 entries (one per parent, nodes 0..n),
  // rank_of[p] = the rank of parent p's candidate in the heap, node_score[i] =
  // score of node i (root 0). Uninitialized: every slot is written before it
  // is read.
  std::unique_ptr<Key[]> storage(new Key[n + 1]);
  std::unique_ptr<uint32_t[]> rank_of(new uint32_t[n + 1]);
  std::unique_ptr<double[]> node_score(new double[n + 1]);
  node_score[0] = 0.0;
  KeyHeap heap(storage.get());
  rank_of[0] = 0;
  heap.push(make_key(logprob(0, 0), 1, 0));
  for (int64_t node = 1; node <= n; ++node) {
    // The heap cannot run empty before n pops: n <= the full tree's size and
    // every node of the full tree is eventually pushed.
    const Key top = heap.top();
    const uint32_t parent = key_parent(top), depth = key_depth(top), rank = rank_of[parent];
    const double score = bits_score(static_cast<uint64_t>(top >> 64));
    const int64_t row = depth - 1;
    tokens[node - 1] = static_cast<int64_t>(ids[row * id_s0 + static_cast<int64_t>(rank) * id_s1]);
    depths[node - 1] = depth;
    parents[node] = parent;
    node_score[node] = score;
    if (scores != nullptr) scores[node - 1] = score;
    if (node == n) break;  // the last node's sibling and child are never popped
    if (rank + 1 < k) {
      rank_of[parent] = rank + 1;
      heap.replace_top(make_key(node_score[parent] + logprob(row, rank + 1), depth, parent));
    } else {
      heap.pop();
    }
    if (depth < max_depth) {
      rank_of[node] = 0;
      heap.push(make_key(score + logprob(row + 1, 0), depth + 1, static_cast<uint32_t>(node)));
    }
  }
}

template <typename lp_t>
void build_tree_dispatch_ids(const torch::Tensor& lp, const torch::Tensor& ids, int64_t n, int64_t* tokens,
                             int64_t* depths, int64_t* parents, double* scores) {
  const lp_t* lp_ptr = lp.data_ptr<lp_t>();
  if (ids.scalar_type() == torch::kInt64) {
    build_tree_loop(lp_ptr, lp.stride(0), lp.stride(1), ids.data_ptr<int64_t>(), ids.stride(0), ids.stride(1),
                    lp.size(0), lp.size(1), n, tokens, depths, parents, scores);
  } else {
    build_tree_loop(lp_ptr, lp.stride(0), lp.stride(1), ids.data_ptr<int32_t>(), ids.stride(0), ids.stride(1),
                    lp.size(0), lp.size(1), n, tokens, depths, parents, scores);
  }
}

// The checked host view of a build's inputs: top_logprobs [depth, K] (one tree) or [b, depth, K] (a batch),
// floating point, and top_ids of the same shape, int64 or int32. They are read in place (any strides, float32
// / float64 directly); GPU tensors are copied to the host first, other float types become float64 (exact:
// every float type converts to double without rounding).
std::pair<torch::Tensor, torch::Tensor> host_build_inputs(const torch::Tensor& top_logprobs_in,
                                                          const torch::Tensor& top_ids_in, int64_t budget) {
  TORCH_CHECK(top_logprobs_in.dim() == 2 || top_logprobs_in.dim() == 3,
              "build_tree: top_logprobs must be 2-D [depth, K] or 3-D [b, depth, K], got shape ",
              top_logprobs_in.sizes());
  TORCH_CHECK(top_ids_in.sizes() == top_logprobs_in.sizes(), "build_tree: top_ids must have the shape of top_logprobs ",
              top_logprobs_in.sizes(), ", got ", top_ids_in.sizes());
  TORCH_CHECK(at::isFloatingType(top_logprobs_in.scalar_type()),
              "build_tree: top_logprobs must be floating point, got ", top_logprobs_in.scalar_type());
  TORCH_CHECK(top_ids_in.scalar_type() == torch::kInt64 || top_ids_in.scalar_type() == torch::kInt32,
              "build_tree: top_ids must be int64 or int32, got ", top_ids_in.scalar_type());
  TORCH_CHECK(budget >= 0, "build_tree: budget must be >= 0, got ", budget);
  const bool lp_native = top_logprobs_in.scalar_type() == torch::kFloat32 ||
                         top_logprobs_in.scalar_type() == torch::kFloat64;
  torch::Tensor lp = top_logprobs_in.device().is_cpu() ? top_logprobs_in : top_logprobs_in.cpu();
  if (!lp_native) lp = lp.to(torch::kFloat64);
  torch::Tensor ids = top_ids_in.device().is_cpu() ? top_ids_in : top_ids_in.cpu();
  return {std::move(lp), std::move(ids)};
}

// The node count of a tree of `budget` nodes over depth x K inputs, checked to fit the uint32 node indices,
// depths and ranks of the heap loop.
int64_t checked_tree_nodes(int64_t max_depth, int64_t k, int64_t budget) {
  constexpr int64_t kMaxNodes = int64_t{1} << 30;
  const int64_t n = full_tree_nodes(max_depth, k, budget < kMaxNodes ? budget : kMaxNodes);
  TORCH_CHECK(n < kMaxNodes, "build_tree: the tree would have ", n, " or more nodes; at most ", kMaxNodes - 1,
              " are supported");
  TORCH_CHECK(k < kMaxNodes && max_depth < kMaxNodes, "build_tree: D and K must be below ", kMaxNodes, ", got ",
              max_depth, " and ", k);
  return n;
}

// build_tree: the trees of [depth, K] inputs (one) or [b, depth, K] (a batch, one heap loop per row, no Python
// loop): (tokens [.., N], depths [.., N], parents [.., N + 1]) int64 and scores [.., N] float64, each node's
// path sum of log-probs (the key the heap popped it by), all plain CPU tensors allocated without the
// dispatcher.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> build_tree_cpu(
    const torch::Tensor& top_logprobs_in, const torch::Tensor& top_ids_in, int64_t budget) {
  const auto inputs = host_build_inputs(top_logprobs_in, top_ids_in, budget);
  const bool batched = inputs.first.dim() == 3;
  const torch::Tensor lp = batched ? inputs.first : inputs.first.unsqueeze(0);
  const torch::Tensor ids = batched ? inputs.second : inputs.second.unsqueeze(0);
  const int64_t b = lp.size(0);
  const int64_t n = checked_tree_nodes(lp.size(1), lp.size(2), budget);
  auto empty = [&](int64_t width, c10::ScalarType dtype) {
    std::vector<int64_t> size{width};
    if (batched) size.insert(size.begin(), b);
    return at::detail::empty_cpu(size, dtype, false, c10::nullopt);
  };
  torch::Tensor out_tokens = empty(n, torch::kInt64), out_depths = empty(n, torch::kInt64);
  torch::Tensor out_parents = empty(n + 1, torch::kInt64), out_scores = empty(n, torch::kFloat64);
  int64_t* tok = out_tokens.data_ptr<int64_t>();
  int64_t* dep = out_depths.data_ptr<int64_t>();
  int64_t* par = out_parents.data_ptr<int64_t>();
  double* sco = out_scores.data_ptr<double>();
  for (int64_t r = 0; r < b; ++r) {
    const torch::Tensor lp_r = lp.select(0, r), ids_r = ids.select(0, r);
    if (lp.scalar_type() == torch::kFloat32) {
      build_tree_dispatch_ids<float>(lp_r, ids_r, n, tok + r * n, dep + r * n, par + r * (n + 1), sco + r * n);
    } else {
      build_tree_dispatch_ids<double>(lp_r, ids_r, n, tok + r * n, dep + r * n, par + r * (n + 1), sco + r * n);
    }
  }
  return {std::move(out_tokens), std::move(out_depths), std::move(out_parents), std::move(out_scores)};
}

// Checks one tree's or a batch's walk inputs (parents [(b,) N+1], token_ids
// [(b,) N], target_choice [(b,) N+1], CPU, int64/int32) and returns them as
// contiguous int64 [b, ...] views (b = 1 for one tree).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> walk_inputs(const torch::Tensor& parents_in,
                                                                    const torch::Tensor& token_ids_in,
                                                                    const torch::Tensor& target_choice_in) {
  const int64_t dim = parents_in.dim();
  if (dim == 1) {
    TORCH_CHECK(parents_in.size(0) >= 1, "walk_tree: parents must be 1-D [N+1] with N+1 >= 1, got shape ",
                parents_in.sizes());
  } else {
    TORCH_CHECK(dim == 2 && parents_in.size(-1) >= 1,
                "walk_tree: parents must be 1-D [N+1] or 2-D [b, N+1] with N+1 >= 1, got shape ", parents_in.sizes());
  }
  const int64_t n_nodes = parents_in.size(-1);  // N + 1, the root included
  const int64_t b = dim == 2 ? parents_in.size(0) : 1;
  if (dim == 1) {
    TORCH_CHECK(token_ids_in.dim() == 1 && token_ids_in.size(0) == n_nodes - 1,
                "walk_tree: token_ids must be 1-D [N] = [", n_nodes - 1, "], got shape ", token_ids_in.sizes());
    TORCH_CHECK(target_choice_in.dim() == 1 && target_choice_in.size(0) == n_nodes,
                "walk_tree: target_choice must be 1-D [N+1] = [", n_nodes, "], got shape ", target_choice_in.sizes());
  } else {
    TORCH_CHECK(token_ids_in.dim() == 2 && token_ids_in.size(0) == b && token_ids_in.size(1) == n_nodes - 1,
                "walk_tree: token_ids must be 2-D [b, N] = [", b, ", ", n_nodes - 1, "], got shape ",
                token_ids_in.sizes());
    TORCH_CHECK(target_choice_in.dim() == 2 && target_choice_in.size(0) == b && target_choice_in.size(1) == n_nodes,
                "walk_tree: target_choice must be 2-D [b, N+1] = [", b, ", ", n_nodes, "], got shape ",
                target_choice_in.sizes());
  }
  for (const torch::Tensor* t : {&parents_in, &token_ids_in, &target_choice_in}) {
    TORCH_CHECK(t->device().is_cpu(), "walk_tree (C++): inputs must be CPU tensors");
    TORCH_CHECK(t->scalar_type() == torch::kInt64 || t->scalar_type() == torch::kInt32,
                "walk_tree: parents, token_ids and target_choice must be int64 or int32, got ", t->scalar_type());
  }
  return {parents_in.to(torch::kInt64).contiguous().view({b, n_nodes}),
          token_ids_in.to(torch::kInt64).contiguous().view({b, n_nodes - 1}),
          target_choice_in.to(torch::kInt64).contiguous().view({b, n_nodes})};
}

// The walk of one tree (n_nodes = N + 1): the accepted nodes from the root
// into `accepted` (cleared first); returns the last one. `child_start` and
// `children` are scratch buffers, resized here.
int64_t walk_one(const int64_t* parents, const int64_t* tokens, const int64_t* choice, int64_t n_nodes,
                 std::vector<int64_t>& accepted, std::vector<int64_t>& child_start, std::vector<int64_t>& fill,
                 std::vector<int64_t>& children) {
  TORCH_CHECK(parents[0] == -1, "walk_tree: parents[0] must be -1 (the root), got ", parents[0]);
  // Children lists in compressed form: child_start[p] .. child_start[p + 1]
  // index `children`, which lists each node's children in increasing order.
  child_start.assign(n_nodes + 1, 0);
  for (int64_t i = 1; i < n_nodes; ++i) {
    TORCH_CHECK(parents[i] >= 0 && parents[i] < i, "walk_tree: parents[", i, "] = ", parents[i],
                " must lie in [0, ", i, ") (a parent precedes its children)");
    ++child_start[parents[i] + 1];
  }
  for (int64_t p = 0; p < n_nodes; ++p) child_start[p + 1] += child_start[p];
  fill.assign(child_start.begin(), child_start.end() - 1);
  children.assign(n_nodes > 0 ? n_nodes - 1 : 0, 0);
  for (int64_t i = 1; i < n_nodes; ++i) children[fill[parents[i]]++] = i;

  accepted.assign(1, 0);
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
  return cur;
}

std::tuple<torch::Tensor, int64_t> walk_tree_cpu(const torch::Tensor& parents_in, const torch::Tensor& token_ids_in,
                                                 const torch::Tensor& target_choice_in) {
  TORCH_CHECK(parents_in.dim() == 1, "walk_tree: parents must be 1-D [N+1] with N+1 >= 1, got shape ",
              parents_in.sizes());
  const auto [parents_t, tokens_t, choice_t] = walk_inputs(parents_in, token_ids_in, target_choice_in);
  const int64_t* choice = choice_t.data_ptr<int64_t>();
  std::vector<int64_t> accepted, child_start, fill, children;
  const int64_t last = walk_one(parents_t.data_ptr<int64_t>(), tokens_t.data_ptr<int64_t>(), choice,
                                parents_t.size(1), accepted, child_start, fill, children);
  torch::Tensor out = torch::empty({static_cast<int64_t>(accepted.size())}, torch::TensorOptions().dtype(torch::kInt64));
  std::copy(accepted.begin(), accepted.end(), out.data_ptr<int64_t>());
  return {out, choice[last]};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> walk_tree_padded_cpu(const torch::Tensor& parents_in,
                                                                             const torch::Tensor& token_ids_in,
                                                                             const torch::Tensor& target_choice_in,
                                                                             int64_t max_depth) {
  TORCH_CHECK(max_depth >= 0, "walk_tree: max_depth must be >= 0, got ", max_depth);
  const auto [parents_t, tokens_t, choice_t] = walk_inputs(parents_in, token_ids_in, target_choice_in);
  const int64_t b = parents_t.size(0), n_nodes = parents_t.size(1), width = max_depth + 1;
  const auto opts = torch::TensorOptions().dtype(torch::kInt64);
  torch::Tensor path = torch::zeros({b, width}, opts), committed = torch::zeros({b, width}, opts);
  torch::Tensor path_len = torch::empty({b}, opts);
  int64_t* path_p = path.data_ptr<int64_t>();
  int64_t* committed_p = committed.data_ptr<int64_t>();
  int64_t* len_p = path_len.data_ptr<int64_t>();
  std::vector<int64_t> accepted, child_start, fill, children;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t* parents = parents_t.data_ptr<int64_t>() + r * n_nodes;
    const int64_t* tokens = tokens_t.data_ptr<int64_t>() + r * (n_nodes - 1);
    const int64_t* choice = choice_t.data_ptr<int64_t>() + r * n_nodes;
    const int64_t last = walk_one(parents, tokens, choice, n_nodes, accepted, child_start, fill, children);
    const int64_t m = static_cast<int64_t>(accepted.size());
    TORCH_CHECK(m <= width, "walk_tree: row ", r, " accepts ", m, " nodes, more than max_depth + 1 = ", width);
    for (int64_t j = 0; j < m; ++j) path_p[r * width + j] = accepted[j];
    for (int64_t j = 1; j < m; ++j) committed_p[r * width + j - 1] = tokens[accepted[j] - 1];
    committed_p[r * width + m - 1] = choice[last];
    len_p[r] = m;
  }
  if (parents_in.dim() == 1) return {path[0], path_len, committed[0]};
  return {path, path_len, committed};
}

}  // namespace

void register_tree_ops(pybind11::module_& m) {
  m.def("build_tree", &build_tree_cpu, pybind11::arg("top_logprobs"), pybind11::arg("top_ids"), pybind11::arg("budget"),
        "Best-first DDTree build of [D, K] or [b, D, K] inputs on the host: returns (token_ids [.., N], depths [.., N], "
        "parents [.., N+1]) int64 and scores [.., N] float64 (each node's path sum of log-probs)");
  m.def("walk_tree", &walk_tree_cpu, pybind11::arg("parents"), pybind11::arg("token_ids"),
        pybind11::arg("target_choice"),
        "Walk of a verified DDTree on CPU tensors: returns (accepted node indices [A] int64, bonus token)");
  m.def("walk_tree_padded", &walk_tree_padded_cpu, pybind11::arg("parents"), pybind11::arg("token_ids"),
        pybind11::arg("target_choice"), pybind11::arg("max_depth"),
        "Walk of one verified DDTree [N+1] or of a batch [b, N+1] on CPU tensors, padded with 0: returns (path "
        "[(b,) D+1], path_len [1] or [b], committed [(b,) D+1]) int64");
}

}  // namespace dflash
