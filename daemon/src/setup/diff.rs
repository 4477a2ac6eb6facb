//! A small line diff for `setup --dry-run`: the change to a config file in unified-diff form
//! (`---`/`+++` headers, `@@ -a,b +c,d @@` hunks with up to [`CONTEXT`] lines of context).
//! Config files are small, so a plain longest-common-subsequence table is enough.

/// Context lines around each change.
pub const CONTEXT: usize = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Same,
    Del,
    Add,
}

/// The unified diff from `before` to `after` of the file `name` (`/dev/null` headers are not
/// used: an absent file is an empty `before`). Empty when they are equal.
pub fn unified(name: &str, before: &str, after: &str) -> String {
    if before == after {
        return String::new();
    }
    let a: Vec<&str> = before.lines().collect();
    let b: Vec<&str> = after.lines().collect();
    let (n, m) = (a.len(), b.len());
    // lcs[i][j]: length of the LCS of a[i..] and b[j..].
    let mut lcs = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let mut ops = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            ops.push((Op::Same, a[i]));
            i += 1;
            j += 1;
        } else if i < n && (j == m || lcs[i + 1][j] >= lcs[i][j + 1]) {
            ops.push((Op::Del, a[i]));
            i += 1;
        } else {
            ops.push((Op::Add, b[j]));
            j += 1;
        }
    }
    let mut out = format!("--- {name}\n+++ {name} (after setup)\n");
    let changed: Vec<usize> = (0..ops.len()).filter(|&k| ops[k].0 != Op::Same).collect();
    let mut k = 0;
    while k < changed.len() {
        let start = changed[k].saturating_sub(CONTEXT);
        let mut end = changed[k];
        while k + 1 < changed.len() && changed[k + 1] <= end + 2 * CONTEXT + 1 {
            k += 1;
            end = changed[k];
        }
        let end = (end + CONTEXT + 1).min(ops.len());
        let (mut a_start, mut b_start) = (1, 1);
        for (op, _) in &ops[..start] {
            match op {
                Op::Same => {
                    a_start += 1;
                    b_start += 1;
                }
                Op::Del => a_start += 1,
                Op::Add => b_start += 1,
            }
        }
        let a_len = ops[start..end].iter().filter(|o| o.0 != Op::Add).count();
        let b_len = ops[start..end].iter().filter(|o| o.0 != Op::Del).count();
        // As diff(1): an empty range starts at the line before it.
        let a_start = if a_len == 0 { a_start - 1 } else { a_start };
        let b_start = if b_len == 0 { b_start - 1 } else { b_start };
        out.push_str(&format!("@@ -{a_start},{a_len} +{b_start},{b_len} @@\n"));
        for (op, line) in &ops[start..end] {
            let mark = match op {
                Op::Same => ' ',
                Op::Del => '-',
                Op::Add => '+',
            };
            out.push(mark);
            out.push_str(line);
            out.push('\n');
        }
        k += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_is_empty() {
        assert_eq!(unified("f", "a\n", "a\n"), "");
    }

    #[test]
    fn hunks_with_context() {
        let before = "1\n2\n3\n4\n5\n6\n7\n8\n9\n";
        let after = "1\n2\n3\nfour\n5\n6\n7\n8\n9\nten\n";
        let d = unified("c.toml", before, after);
        assert_eq!(
            d,
            "--- c.toml\n+++ c.toml (after setup)\n@@ -2,5 +2,5 @@\n 2\n 3\n-4\n+four\n 5\n 6\n@@ -8,2 +8,3 @@\n 8\n 9\n+ten\n"
        );
        let added = unified("n", "", "x\ny\n");
        assert!(added.ends_with("@@ -0,0 +1,2 @@\n+x\n+y\n"), "{added}");
    }
}
