{{/* Name of every object of this release: <release>-kvferry, or the release name when it already says kvferry. */}}
{{- define "kvferry.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains "kvferry" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvferry" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels every object carries. No chart version here: a chart upgrade that changes
     nothing else must not rewrite every object. */}}
{{- define "kvferry.labels" -}}
app.kubernetes.io/name: kvferry-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kvferry
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The operator pod's selector. Deliberately not app.kubernetes.io/name=kvferry: that
     label marks the prefill/decode pods (the report endpoint admits those). */}}
{{- define "kvferry.selectorLabels" -}}
app.kubernetes.io/name: kvferry-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvferry.operatorImage" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvferry.sidecarImage" -}}
{{ .Values.sidecarImage.repository }}:{{ .Values.sidecarImage.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvferry.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "kvferry.fullname" .)) -}}
{{- end -}}

{{/* DNS names of the report endpoint's Service, as the sidecars address it. */}}
{{- define "kvferry.serviceHost" -}}
{{ include "kvferry.fullname" . }}.{{ .Release.Namespace }}.svc
{{- end -}}

{{/* The sidecar pods' label (set by the operator's renderer on every prefill/decode pod). */}}
{{- define "kvferry.serverPodSelector" -}}
app.kubernetes.io/name: kvferry
app.kubernetes.io/managed-by: kvferry-operator
{{- end -}}
