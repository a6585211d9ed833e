//! Every limit on the size of the input, in one place.
//!
//! Each limit is far above any real job, yet low enough that absurd input is refused with a
//! clear error (exit code 2, naming the field and the value) before memory or time explode.
//! Input that is merely large stays within them, and the algorithms keep its memory and time
//! linear in it (see the `plan` module docs).
//!
//! Bounds that belong to a file or wire format (a safetensors header, a control frame) stay
//! with the code that reads that format.

/// Global ranks are below 2^31, so that rank arithmetic (a rank plus a mesh size, a position
/// times a stride) never overflows, on any platform.
pub const MAX_RANK: usize = 1 << 31;

/// Ranks of one side of a reshard (the positions of one mesh): 2^24, about 16.8 million,
/// over 100 times the largest GPU clusters built. A side's plan holds a few words per rank,
/// so this bounds a plan's bookkeeping to a few hundred MiB, where an unbounded `ranks=` list
/// or `mesh=` would take all memory.
pub const MAX_MESH_RANKS: usize = 1 << 24;

/// Processes `reshard launch --nproc` starts on this one host: 1024, several times the cores
/// of the largest single machines. Each is a full process with its own sockets; 100000 of
/// them would exhaust the host's process and file limits before any rank could join.
pub const MAX_LOCAL_PROCESSES: usize = 1024;

/// Ranks that `--transport local` runs as threads of one process (two threads each): 4096.
/// Beyond it, a process runs out of threads and stack long before the reshard finishes;
/// larger jobs run one process per rank.
pub const MAX_LOCAL_RANKS: usize = 4096;

/// Pieces one fused buffer may be cut into on one rank (a fused parameter whose members
/// interleave along an inner dim): 2^20. Each piece is a separate region to plan and copy;
/// more would make a refit plan grow without bound for one odd fusion.
pub const MAX_FUSED_PIECES: usize = 1 << 20;

/// Decoder layers of a model config (`num_hidden_layers`): 16384. The deepest published
/// transformers have a few hundred. The refit lists about 20 tensors per layer, so
/// `num_hidden_layers: 100000000` would ask for billions of tensors (tens of GB) before
/// anything could be checked.
pub const MAX_LAYERS: u64 = 1 << 14;

/// Ranks a host map (`--hosts`, or the one learned at rendezvous) covers: a job's global ranks,
/// both sides of a reshard at most, so twice [`MAX_MESH_RANKS`]. A map holds 4 bytes a rank.
pub const MAX_HOST_MAP_RANKS: usize = 2 * MAX_MESH_RANKS;

// a side's ranks, offset by another side's, stay below 2^31; a launch fits in one side
const _: () = assert!(MAX_MESH_RANKS * 2 < MAX_RANK);
const _: () = assert!(MAX_LOCAL_PROCESSES <= MAX_MESH_RANKS);
