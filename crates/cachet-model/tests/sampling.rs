//! Sampling on hand-made logits.

use cachet_core::SamplingParams;
use cachet_model::sampling::{filtered_distribution, sample, SampleInput, SamplerScratch};

fn input<'a>(params: &'a SamplingParams, prompt: &'a [u32], output: &'a [u32]) -> SampleInput<'a> {
    SampleInput {
        params,
        prompt,
        output,
        eos_token_ids: &[],
        fallback_seed: 42,
    }
}

fn draw(logits: &[f32], params: &SamplingParams, output: &[u32]) -> u32 {
    sample(
        logits,
        &input(params, &[], output),
        &mut SamplerScratch::default(),
    )
    .token
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let p = SamplingParams::greedy(4);
    assert_eq!(draw(&[0.1, 2.0, -1.0, 2.0], &p, &[]), 1);
    assert_eq!(draw(&[f32::NEG_INFINITY, -3.0, -2.0], &p, &[]), 2);
}

#[test]
fn top_k_1_equals_greedy() {
    let logits: Vec<f32> = (0..100)
        .map(|i| ((i * 37 % 101) as f32).sin() * 3.0)
        .collect();
    let greedy = draw(&logits, &SamplingParams::greedy(1), &[]);
    for seed in 0..20 {
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 1,
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(draw(&logits, &p, &[]), greedy);
    }
}

#[test]
fn same_seed_same_draw_whatever_else_is_sampled() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).cos()).collect();
    let p = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        ..Default::default()
    };
    let mut s = SamplerScratch::default();
    let out: Vec<u32> = vec![3, 4, 5];
    let a = sample(&logits, &input(&p, &[], &out), &mut s).token;
    // Other requests sampled in between (other seeds, other fallback seeds) change nothing.
    for k in 0..5 {
        let q = SamplingParams {
            temperature: 1.0,
            seed: Some(k),
            ..Default::default()
        };
        let _ = sample(&logits, &input(&q, &[], &[]), &mut s);
    }
    let b = sample(
        &logits,
        &SampleInput {
            fallback_seed: 999,
            ..input(&p, &[], &out)
        },
        &mut s,
    )
    .token;
    assert_eq!(a, b);
    // The draw depends on the step: over many steps the seeded stream is not constant.
    let steps: Vec<u32> = (0..30).map(|n| draw(&logits, &p, &vec![0; n])).collect();
    assert!(steps.iter().any(|&t| t != steps[0]));
    // And on the seed.
    let other: Vec<u32> = (0..30)
        .map(|n| {
            draw(
                &logits,
                &SamplingParams {
                    seed: Some(8),
                    ..p.clone()
                },
                &vec![0; n],
            )
        })
        .collect();
    assert_ne!(steps, other);
}

#[test]
fn penalties_change_the_argmax_as_derived_by_hand() {
    // logits: [2.0, 1.9, 1.0, -0.5]; argmax 0.
    let logits = [2.0f32, 1.9, 1.0, -0.5];
    // Repetition 1.1 on token 0 (seen in the prompt): 2.0 / 1.1 = 1.818 < 1.9 → argmax 1.
    let p = SamplingParams {
        repetition_penalty: 1.1,
        ..Default::default()
    };
    assert_eq!(
        sample(
            &logits,
            &input(&p, &[0], &[]),
            &mut SamplerScratch::default()
        )
        .token,
        1
    );
    // Repetition 1.05: 2.0 / 1.05 = 1.905 > 1.9 → still 0.
    let p = SamplingParams {
        repetition_penalty: 1.05,
        ..Default::default()
    };
    assert_eq!(
        sample(
            &logits,
            &input(&p, &[0], &[]),
            &mut SamplerScratch::default()
        )
        .token,
        0
    );
    // Presence 0.2 applies to outputs only: token 0 in the prompt is not penalised...
    let p = SamplingParams {
        presence_penalty: 0.2,
        ..Default::default()
    };
    assert_eq!(
        sample(
            &logits,
            &input(&p, &[0], &[]),
            &mut SamplerScratch::default()
        )
        .token,
        0
    );
    // ...but in the output it is: 2.0 - 0.2 = 1.8 < 1.9 → 1.
    assert_eq!(
        sample(
            &logits,
            &input(&p, &[], &[0]),
            &mut SamplerScratch::default()
        )
        .token,
        1
    );
    // Frequency 0.06 with token 0 generated once: 1.94 > 1.9 → 0; twice: 1.88 < 1.9 → 1.
    let p = SamplingParams {
        frequency_penalty: 0.06,
        ..Default::default()
    };
    assert_eq!(
        sample(
            &logits,
            &input(&p, &[], &[0]),
            &mut SamplerScratch::default()
        )
        .token,
        0
    );
    assert_eq!(
        sample(
            &logits,
            &input(&p, &[], &[0, 0]),
            &mut SamplerScratch::default()
        )
        .token,
        1
    );
    // Negative logits are multiplied: token 3 (-0.5) with repetition 2 → -1.0 (never raised).
    let neg = [-0.6f32, -1.0, -0.5];
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..Default::default()
    };
    assert_eq!(
        sample(&neg, &input(&p, &[2], &[]), &mut SamplerScratch::default()).token,
        0
    );
}

#[test]
fn min_tokens_masks_eos() {
    let logits = [0.0f32, 5.0, 1.0];
    let p = SamplingParams {
        min_tokens: 2,
        ..Default::default()
    };
    let inp = SampleInput {
        eos_token_ids: &[1],
        ..input(&p, &[], &[7])
    };
    assert_eq!(
        sample(&logits, &inp, &mut SamplerScratch::default()).token,
        2
    );
    let inp = SampleInput {
        eos_token_ids: &[1],
        ..input(&p, &[], &[7, 7])
    };
    assert_eq!(
        sample(&logits, &inp, &mut SamplerScratch::default()).token,
        1
    );
}

fn ln(ps: &[f32]) -> Vec<f32> {
    ps.iter().map(|p| p.ln()).collect()
}

#[test]
fn top_p_and_min_p_filter_a_hand_made_distribution() {
    // Probabilities 0.5, 0.2, 0.15, 0.1, 0.05 (as log-probs, temperature 1).
    let logits = ln(&[0.1, 0.5, 0.05, 0.2, 0.15]);
    let ids = |d: Vec<(u32, f32)>| d.into_iter().map(|(i, _)| i).collect::<Vec<_>>();
    let base = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    // top-p 0.7: 0.5 + 0.2 reaches 0.7 → {1, 3}.
    let d = filtered_distribution(
        &logits,
        &SamplingParams {
            top_p: 0.7,
            ..base.clone()
        },
    );
    assert_eq!(ids(d.clone()), vec![1, 3]);
    assert!((d[0].1 - 0.5 / 0.7).abs() < 1e-5);
    // top-p 0.8: needs 0.15 too → {1, 3, 4}.
    assert_eq!(
        ids(filtered_distribution(
            &logits,
            &SamplingParams {
                top_p: 0.8,
                ..base.clone()
            }
        )),
        vec![1, 3, 4]
    );
    // min-p 0.25: threshold 0.125 → {1, 3, 4}; min-p 0.5: threshold 0.25 → {1}.
    assert_eq!(
        ids(filtered_distribution(
            &logits,
            &SamplingParams {
                min_p: 0.25,
                ..base.clone()
            }
        )),
        vec![1, 3, 4]
    );
    assert_eq!(
        ids(filtered_distribution(
            &logits,
            &SamplingParams {
                min_p: 0.5,
                ..base.clone()
            }
        )),
        vec![1]
    );
    // top-k 2 then min-p 0.5 of the renormalised {0.5, 0.2}: threshold 0.357 → {1}.
    assert_eq!(
        ids(filtered_distribution(
            &logits,
            &SamplingParams {
                top_k: 2,
                min_p: 0.5,
                ..base.clone()
            }
        )),
        vec![1]
    );
    // Draws only ever return kept tokens.
    for seed in 0..200 {
        let p = SamplingParams {
            top_p: 0.7,
            seed: Some(seed),
            ..base.clone()
        };
        assert!([1, 3].contains(&draw(&logits, &p, &[])));
    }
    // And roughly in proportion (0.714 vs 0.286) over many seeds.
    let n1 = (0..2000)
        .filter(|&s| {
            draw(
                &logits,
                &SamplingParams {
                    top_p: 0.7,
                    seed: Some(s),
                    ..base.clone()
                },
                &[],
            ) == 1
        })
        .count();
    assert!((1300..1560).contains(&n1), "{n1}");
}

#[test]
fn logprobs_are_log_softmax_of_raw_logits() {
    let logits = ln(&[0.1, 0.5, 0.05, 0.2, 0.15]);
    let p = SamplingParams {
        logprobs: Some(3),
        repetition_penalty: 3.0,
        ..Default::default()
    };
    let s = sample(
        &logits,
        &input(&p, &[1], &[]),
        &mut SamplerScratch::default(),
    );
    // The penalty moved the argmax off token 1, but logprobs stay unpenalised.
    assert_eq!(s.token, 3);
    assert!((s.logprob - 0.2f32.ln()).abs() < 1e-5);
    let top: Vec<u32> = s.top_logprobs.iter().map(|x| x.0).collect();
    assert_eq!(top, vec![1, 3, 4]);
    assert!((s.top_logprobs[0].1 - 0.5f32.ln()).abs() < 1e-5);
}

/// The lane-parallel argmax against the plain first-maximum scan: ties (lowest index wins),
/// NaN (never wins), all -inf (index 0), and lengths around the 16-lane width.
#[test]
fn argmax_matches_a_plain_scan() {
    fn plain(xs: &[f32]) -> usize {
        let (mut best, mut bv) = (0, f32::NEG_INFINITY);
        for (i, &v) in xs.iter().enumerate() {
            if v > bv {
                (best, bv) = (i, v);
            }
        }
        best
    }
    let mut seed = 1u64;
    for len in [1usize, 2, 15, 16, 17, 31, 32, 33, 100, 49152] {
        for case in 0..20 {
            let xs: Vec<f32> = (0..len)
                .map(|_| {
                    seed = cachet_model::sampling::splitmix64(seed);
                    match (case, seed % 13) {
                        (0, _) => f32::NEG_INFINITY,
                        (_, 0) => f32::NAN,
                        (_, 1) => f32::NEG_INFINITY,
                        // Few distinct values: many ties.
                        _ => (seed % 7) as f32,
                    }
                })
                .collect();
            assert_eq!(
                cachet_model::sampling::argmax(&xs),
                plain(&xs),
                "len {len} case {case}"
            );
        }
    }
    assert_eq!(cachet_model::sampling::argmax(&[f32::NAN, 1.0]), 1);
}
