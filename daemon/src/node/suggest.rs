//! "Did you mean …?": the known names closest to a mistyped one, by edit distance (wire.md §4:
//! up to 3 suggestions).

/// Most suggestions given for one name.
pub const MAX_SUGGESTIONS: usize = 3;

/// The names in `known` close enough to `typed` to be what was meant, closest first (ties by
/// name), at most [`MAX_SUGGESTIONS`], without duplicates or `typed` itself. Close enough: at
/// most `max(2, len / 3)` edits (insertions, deletions, substitutions, or swaps of two
/// neighbouring characters), where `len` is `typed`'s length in characters.
pub fn closest<'a>(typed: &str, known: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    closest_labelled(typed, known.into_iter().map(|k| (k, k.to_string())))
}

/// As [`closest`], for names shown under a label (e.g. `bob@work` for the name `bob` on a
/// paired host): each `(name, label)` is compared by `name` and answered by `label`; closest
/// first (ties by label), at most [`MAX_SUGGESTIONS`] labels, without duplicate labels or
/// entries whose name is `typed` itself.
pub fn closest_labelled<'a>(
    typed: &str,
    known: impl IntoIterator<Item = (&'a str, String)>,
) -> Vec<String> {
    let limit = (typed.chars().count() / 3).max(2);
    let mut scored: Vec<(usize, String)> = known
        .into_iter()
        .filter(|(k, _)| *k != typed)
        .map(|(k, label)| (distance(typed, k), label))
        .filter(|(d, _)| *d <= limit)
        .collect();
    scored.sort();
    scored.dedup_by(|a, b| a.1 == b.1);
    scored
        .into_iter()
        .take(MAX_SUGGESTIONS)
        .map(|(_, label)| label)
        .collect()
}

/// Edits from `a` to `b`: insertions, deletions, substitutions and swaps of two neighbouring
/// characters, each counting one (optimal string alignment distance), over `char`s.
pub fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // rows[i][j]: edits from a[..i] to b[..j].
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = d;
        }
    }
    rows[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_counts_each_edit_and_a_swap_as_one() {
        assert_eq!(distance("hots", "host"), 1);
        assert_eq!(distance("hots", "hostb"), 2);
        assert_eq!(distance("", "ab"), 2);
        assert_eq!(distance("same", "same"), 0);
        assert_eq!(distance("kitten", "sitting"), 3);
    }

    #[test]
    fn closest_gives_up_to_three_near_names_closest_first() {
        let known = ["hostb", "hosta", "work", "hostc", "hostd", "laptop"];
        assert_eq!(closest("hots", known), vec!["hosta", "hostb", "hostc"]);
        assert_eq!(closest("wrok", known), vec!["work"]);
        assert!(closest("zzzzzz", known).is_empty());
        assert!(
            closest("work", ["work"]).is_empty(),
            "never the name itself"
        );
    }
}
