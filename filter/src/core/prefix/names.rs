//! Interned model and pod names of the prefix index.

use hashbrown::HashMap;

use super::tree::NIL;

/// Model and pod names, interned so a holder is two `u32`s. Reference-counted
/// by holders, so names of pods that left the fleet are freed with their last holder.
#[derive(Debug, Default)]
pub(super) struct Names {
    ids: HashMap<Box<str>, u32>,
    slots: Vec<(Box<str>, usize)>,
    free: Vec<u32>,
}

impl Names {
    pub(super) fn get(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The name behind a live id.
    pub(super) fn name(&self, id: u32) -> Option<&str> {
        self.slots.get(id as usize).map(|(name, _)| &**name)
    }

    /// The id of `name`, with one more reference.
    pub(super) fn acquire(&mut self, name: &str) -> u32 {
        if let Some(id) = self.get(name) {
            self.add_ref(id);
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = (name.into(), 1);
                id
            }
            None => {
                // Fewer names than blocks ever exist, and the block count fits in u32.
                let id = u32::try_from(self.slots.len()).unwrap_or(NIL);
                self.slots.push((name.into(), 1));
                id
            }
        };
        self.ids.insert(name.into(), id);
        id
    }

    pub(super) fn add_ref(&mut self, id: u32) {
        if let Some(slot) = self.slots.get_mut(id as usize) {
            slot.1 += 1;
        }
    }

    pub(super) fn release(&mut self, id: u32) {
        let Some(slot) = self.slots.get_mut(id as usize) else {
            return;
        };
        slot.1 = slot.1.saturating_sub(1);
        if slot.1 == 0 {
            let name = std::mem::take(&mut slot.0);
            self.ids.remove(&name);
            self.free.push(id);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }
}
