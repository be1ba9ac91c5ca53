//! Admission: the checks that decide, before any page is reserved or any model work starts,
//! whether a request can be served at all; and the startup check that a pool fits the models
//! it serves. There is no truncation and no placeholder path: a request either fits or fails.

use crate::error::AdmissionError;

/// Default ratio of KV pool tokens to a model's context window.
pub const DEFAULT_SAFETY_FACTOR: f64 = 2.0;

/// Check a tokenized generation request against the model's window and the pool.
pub fn check_generation(
    prompt_tokens: usize,
    max_tokens: usize,
    context_window: usize,
    pool_capacity_tokens: usize,
) -> Result<(), AdmissionError> {
    if prompt_tokens == 0 {
        return Err(AdmissionError::EmptyPrompt);
    }
    if prompt_tokens > context_window {
        return Err(AdmissionError::PromptExceedsContext {
            prompt: prompt_tokens,
            context_window,
        });
    }
    // `max_tokens` comes from a client: a sum past `usize::MAX` exceeds every window.
    let Some(needed) = prompt_tokens
        .checked_add(max_tokens)
        .filter(|&n| n <= context_window)
    else {
        return Err(AdmissionError::PromptPlusMaxTokensExceedsContext {
            prompt: prompt_tokens,
            max_tokens,
            context_window,
        });
    };
    // Impossible after the startup check (pool >= window x factor >= window), and still checked.
    if needed > pool_capacity_tokens {
        return Err(AdmissionError::ExceedsPool {
            needed,
            capacity: pool_capacity_tokens,
        });
    }
    Ok(())
}

/// A model as the capacity check sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ServedModel {
    pub name: String,
    pub context_window: usize,
}

/// Why a pool is too small for what it serves.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CapacityError {
    #[error("safety factor {0} is below 1.0: a pool must hold at least one full context window")]
    FactorBelowOne(f64),
    #[error(
        "KV pool of {pool_tokens} tokens is too small for model {model}: context window \
         {context_window} x safety factor {factor} = {required} tokens required"
    )]
    PoolTooSmall {
        model: String,
        pool_tokens: usize,
        context_window: usize,
        factor: f64,
        required: usize,
    },
}

/// Tokens a pool must hold to serve a model of `context_window` with `factor` (saturating:
/// a product past `usize::MAX` is a requirement no pool meets).
pub fn required_pool_tokens(context_window: usize, factor: f64) -> usize {
    // A float-to-int `as` saturates, and NaN becomes 0 (a NaN factor is refused by `check`).
    (context_window as f64 * factor).ceil() as usize
}

/// A pool against one model it serves: the numbers of the pre-deployment check. The one fit
/// rule that node startup, `bulkhead check`, the catalog's publish gate, the control plane's
/// routing and its node listing all apply, so they cannot disagree.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolFit {
    pub model: String,
    pub pool_tokens: usize,
    pub context_window: usize,
    pub factor: f64,
    /// `context_window x factor`, rounded up.
    pub required_tokens: usize,
}

impl PoolFit {
    pub fn new(model: &str, context_window: usize, pool_tokens: usize, factor: f64) -> PoolFit {
        PoolFit {
            model: model.to_string(),
            pool_tokens,
            context_window,
            factor,
            required_tokens: required_pool_tokens(context_window, factor),
        }
    }

    /// Whether the pool holds the model's window times the factor, with the numbers if not.
    pub fn check(&self) -> Result<(), CapacityError> {
        if self.factor.is_nan() || self.factor < 1.0 {
            return Err(CapacityError::FactorBelowOne(self.factor));
        }
        if self.pool_tokens < self.required_tokens {
            return Err(CapacityError::PoolTooSmall {
                model: self.model.clone(),
                pool_tokens: self.pool_tokens,
                context_window: self.context_window,
                factor: self.factor,
                required: self.required_tokens,
            });
        }
        Ok(())
    }
}

/// The pre-deployment check of a whole pool: does `pool_tokens` fit every model it serves?
pub fn check_pool_fits(
    pool_tokens: usize,
    models: &[ServedModel],
    factor: f64,
) -> Result<(), CapacityError> {
    if factor.is_nan() || factor < 1.0 {
        return Err(CapacityError::FactorBelowOne(factor));
    }
    models
        .iter()
        .try_for_each(|m| PoolFit::new(&m.name, m.context_window, pool_tokens, factor).check())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_has_its_own_error_with_numbers() {
        assert_eq!(
            check_generation(0, 10, 100, 1000),
            Err(AdmissionError::EmptyPrompt)
        );
        let e = check_generation(5000, 256, 4096, 8192).unwrap_err();
        assert_eq!(
            e.to_string(),
            "prompt 5000 tokens exceeds context window 4096"
        );
        let e = check_generation(4000, 256, 4096, 8192).unwrap_err();
        assert_eq!(
            e.to_string(),
            "prompt 4000 + max_tokens 256 exceeds context window 4096"
        );
        let e = check_generation(100, 100, 4096, 150).unwrap_err();
        assert_eq!(
            e.to_string(),
            "request needs 200 KV tokens but the pool holds only 150"
        );
        assert!(
            check_generation(3840, 256, 4096, 8192).is_ok(),
            "exactly at the limit fits"
        );
    }

    #[test]
    fn the_incident_deployment_is_refused() {
        // 2026: a 1,048,576-token window on a 681,280-token prefill pool.
        let models = [ServedModel {
            name: "m".into(),
            context_window: 1_048_576,
        }];
        let err = check_pool_fits(681_280, &models, DEFAULT_SAFETY_FACTOR).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("681280") && msg.contains("1048576") && msg.contains("2097152"),
            "{msg}"
        );
        // Even with factor 1.0 it does not fit.
        assert!(check_pool_fits(681_280, &models, 1.0).is_err());
        assert!(check_pool_fits(2_097_152, &models, 2.0).is_ok());
    }

    /// A client's `max_tokens` near `usize::MAX` once overflowed `prompt + max_tokens` (a
    /// panic with overflow checks; without them, a wrapped sum that was admitted).
    #[test]
    fn a_huge_max_tokens_is_refused_not_overflowed() {
        let e = check_generation(10, usize::MAX, 4096, 8192).unwrap_err();
        assert!(
            matches!(
                e,
                AdmissionError::PromptPlusMaxTokensExceedsContext { max_tokens, .. }
                    if max_tokens == usize::MAX
            ),
            "{e:?}"
        );
        assert!(check_generation(2, usize::MAX - 1, usize::MAX, usize::MAX).is_err());
    }

    #[test]
    fn one_fit_rule_with_its_numbers() {
        let fit = PoolFit::new("m", 4096, 8000, 2.0);
        assert_eq!(fit.required_tokens, 8192);
        let msg = fit.check().unwrap_err().to_string();
        assert!(
            msg.contains("8000") && msg.contains("4096") && msg.contains("8192"),
            "{msg}"
        );
        assert!(PoolFit::new("m", 4096, 8192, 2.0).check().is_ok());
        // A window too large to multiply needs more than any pool.
        let huge = PoolFit::new("m", usize::MAX, usize::MAX - 1, 2.0);
        assert!(huge.check().is_err());
        assert!(matches!(
            PoolFit::new("m", 1, 10, f64::NAN).check(),
            Err(CapacityError::FactorBelowOne(_))
        ));
    }

    #[test]
    fn factor_below_one_is_refused() {
        assert!(matches!(
            check_pool_fits(10, &[], 0.5),
            Err(CapacityError::FactorBelowOne(_))
        ));
    }
}
