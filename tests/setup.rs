//! `agentmbx setup` against fake homes (black-box tests; filled in by the next commit).
