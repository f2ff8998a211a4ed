//! Per-tenant totals: a label of its own for each of the first tenants seen (up to the
//! configured number), "other" for the rest. The list only grows, so a tenant keeps its index.

use std::collections::HashMap;
use std::sync::Arc;

use crate::stats::TenantTotals;

#[derive(Debug)]
pub(super) struct Tenants {
    max: usize,
    index: HashMap<Arc<str>, usize>,
    list: Vec<TenantTotals>,
    other: Option<usize>,
    /// The tenant looked up last and its index: consecutive requests are mostly one
    /// tenant's, and comparing a short name costs less than hashing it.
    last: Option<(Arc<str>, usize)>,
}

impl Tenants {
    /// At most `max` tenants with a label of their own.
    pub(super) fn new(max: usize) -> Self {
        Tenants {
            max,
            index: HashMap::new(),
            list: Vec::new(),
            other: None,
            last: None,
        }
    }

    pub(super) fn index_of(&mut self, t: &Arc<str>) -> usize {
        if let Some((l, i)) = &self.last {
            if Arc::ptr_eq(l, t) || **l == **t {
                return *i;
            }
        }
        let i = self.find_or_add(t);
        self.last = Some((t.clone(), i));
        i
    }

    fn find_or_add(&mut self, t: &Arc<str>) -> usize {
        if let Some(&i) = self.index.get(t) {
            return i;
        }
        if self.index.len() < self.max {
            let i = self.list.len();
            self.list.push(TenantTotals {
                tenant: t.clone(),
                ..Default::default()
            });
            self.index.insert(t.clone(), i);
            return i;
        }
        *self.other.get_or_insert_with(|| {
            self.list.push(TenantTotals {
                tenant: Arc::from("other"),
                ..Default::default()
            });
            self.list.len() - 1
        })
    }

    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut TenantTotals> {
        self.list.get_mut(i)
    }

    pub(super) fn list(&self) -> &[TenantTotals] {
        &self.list
    }

    /// The label of tenant `i`.
    pub(super) fn name(&self, i: usize) -> Option<Arc<str>> {
        self.list.get(i).map(|t| t.tenant.clone())
    }
}
