//! Where in the language model's depth the paper's layer rules look
//! (`docs/reference/visual-sinks.md`, "The peak layer" and "Top-1 localization").

/// The first layer the peak-layer rule counts: `⌈n / 4⌉` of `n` layers. The paper skips the
/// first quarter of depth, whose layers attend diffusely.
pub fn first_counted_layer(num_layers: usize) -> usize {
    num_layers.div_ceil(4)
}

/// The first layer of the upper half of `n` layers: layer L (0-based) is in it when `2L ≥ n`,
/// so `⌈n / 2⌉` (18 of 36, 2 of 3). Table 10 averages over the probed layers from here on.
pub fn upper_half_start(num_layers: usize) -> usize {
    num_layers.div_ceil(2)
}

/// The re-look's default selector layers (the paper's Table 13), 0-based as in transformers:
/// 18 and 21 of 36 layers, 14 and 16 of 28, and for any other depth n, `round(n·18/36)` and
/// `round(n·21/36)` (halves up) made distinct: the second moves one layer deeper when the two
/// coincide, or the first one shallower at the last layer. One layer when the model has one.
/// `visual-sinks --plot` marks them on Figure 8; the upcoming `relook` command is to take them
/// unless its `--selector-layers` overrides them.
pub fn selector_layers(num_layers: usize) -> Vec<usize> {
    let last = num_layers.saturating_sub(1);
    // round(n·k/36), halves up, in integers so that no depth rounds by float error.
    let at = |k: usize| ((num_layers * k + 18) / 36).min(last);
    let (mut first, mut second) = (at(18), at(21));
    if first == second {
        if second < last {
            second += 1;
        } else {
            first = first.saturating_sub(1);
        }
    }
    if first == second {
        vec![first]
    } else {
        vec![first, second]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selector_layers_follow_the_paper_and_scale_with_depth() {
        assert_eq!(selector_layers(36), [18, 21]);
        assert_eq!(selector_layers(28), [14, 16]);
        // 24·18/36 = 12, 24·21/36 = 14; 12·21/36 = 7.
        assert_eq!(selector_layers(24), [12, 14]);
        assert_eq!(selector_layers(12), [6, 7]);
        // 3 layers: round(1.5) = 2 = round(1.75), the last layer, so the first moves up.
        assert_eq!(selector_layers(3), [1, 2]);
        // 4 layers: 2 and round(2.33) = 2, so the second moves one layer deeper.
        assert_eq!(selector_layers(4), [2, 3]);
        assert_eq!(selector_layers(2), [0, 1]);
        assert_eq!(selector_layers(1), [0]);
        for n in 2..200 {
            let s = selector_layers(n);
            assert!(s.len() == 2 && s[0] < s[1] && s[1] < n, "{n}: {s:?}");
        }
    }

    #[test]
    fn the_quarter_and_the_half_round_up() {
        assert_eq!(first_counted_layer(36), 9);
        assert_eq!(first_counted_layer(3), 1);
        assert_eq!(upper_half_start(36), 18);
        assert_eq!(upper_half_start(3), 2);
        assert_eq!(upper_half_start(28), 14);
    }
}
