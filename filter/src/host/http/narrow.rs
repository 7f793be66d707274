//! The `external-filter` header (AIBrix's): a label selector that narrows the pods a request
//! may go to before any strategy picks among them.

use std::rc::Rc;

use super::PdHttp;
use crate::core::errors::RouteError;
use crate::core::fleet::ModelView;

impl PdHttp {
    /// The `external-filter` header's label selector, when the request carries a non-empty
    /// one (one that does not parse is a selection failure, 503, as in AIBrix).
    fn external_filter(&self) -> Option<String> {
        self.forwarded_value("external-filter")
            .map(|text| text.trim().to_string())
            .filter(|text| !text.is_empty())
    }

    /// `model` narrowed to the pods the request's `external-filter` selector matches, when it
    /// carries one.
    pub(super) fn narrowed_view(
        &mut self,
        model: &ModelView,
        model_name: &str,
    ) -> Result<Option<Rc<ModelView>>, RouteError> {
        let Some(text) = self.external_filter() else {
            return Ok(None);
        };
        self.narrowed = true;
        let narrowed = self
            .vm
            .borrow_mut()
            .narrowed
            .narrow(model, &text)
            .map_err(|e| RouteError::Selection {
                detail: format!("external-filter {text:?}: {e}"),
            })?;
        if narrowed.pods.is_empty() {
            return Err(RouteError::Selection {
                detail: format!(
                    "external-filter matched none of the {} routable pods of model {}",
                    model.pods.len(),
                    model_name
                ),
            });
        }
        Ok(Some(narrowed))
    }
}
